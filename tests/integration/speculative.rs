//! Speculative rollouts: an MTP draft proposes, the policy verifies. Greedy decoding gives the
//! plain tokens, sampled tokens follow the policy's distribution, rollout logprobs equal the
//! scorer's bit for bit, and bad drafts or settings are refused.

use miles_core::{Flow, Sample, SamplingParams};
use miles_model::draft::{Draft, DraftFormat, draft_config, fit_draft};
use miles_model::testing::on_cpu;
use miles_model::{Architecture, DeviceModel, KvCache, Model, PackedBatch, Weights, presets};

use crate::rollout::{groups_of, model, perturb};
use miles_rollout::{Engine, EngineConfig};
use miles_tensor::cpu::{AdamW, kept_masses};
use std::sync::Arc;

/// A random MTP draft of `policy` (its embedding and head the policy's), on the CPU.
fn draft(policy: &Model, seed: u64) -> DeviceModel {
    let pc = &policy.config;
    let mut w = Draft::random(pc, DraftFormat::DeepSeek, seed)
        .unwrap()
        .model_weights(pc, &policy.weights)
        .unwrap();
    let shared = [w.embed.clone(), w.lm_head.clone().unwrap_or_default()];
    perturb(w.tensors_mut().into_iter().filter(|t| !shared.contains(*t)).collect(), seed);
    on_cpu(&Model::new(draft_config(pc).unwrap(), w))
}

/// Trains `draft` on the policy's `samples` ([`fit_draft`]), `steps` AdamW steps.
fn warm_up(policy: &DeviceModel, draft: &mut DeviceModel, samples: &[Sample], steps: usize) {
    let seqs: Vec<(Vec<u32>, usize)> =
        samples.iter().map(|s| (s.tokens.clone(), s.prompt_length().unwrap())).collect();
    let hyper = AdamW { lr: 1e-2, beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 0.0 };
    fit_draft(policy, draft, &PackedBatch::new(&seqs).unwrap(), steps, &hyper).unwrap().unwrap();
}

fn params(max_new: usize, top_k: usize) -> SamplingParams {
    SamplingParams {
        temperature: 0.8,
        top_p: 0.95,
        top_k,
        max_new_tokens: max_new,
        ignore_eos: true,
        seed: 7,
        ..SamplingParams::default()
    }
}

fn spec_engine(policy: &DeviceModel, draft: &DeviceModel, config: EngineConfig) -> Engine {
    Engine::with_draft(policy, draft, None, config).unwrap()
}

/// (tokens, logprob bits) of every sample.
fn results(groups: &[Vec<Sample>]) -> Vec<(Vec<u32>, Vec<u32>)> {
    groups
        .iter()
        .flatten()
        .map(|s| (s.tokens.clone(), s.rollout_log_probs.iter().map(|v| v.to_bits()).collect()))
        .collect()
}

/// Greedy decoding with speculation gives exactly the plain tokens and logprobs, at every
/// draft length, with prompts across block boundaries, under preemption, and for a mixture of
/// experts its routing record too.
#[test]
fn greedy_speculative_decoding_gives_the_plain_tokens() {
    let lens = [5, 64, 70, 13, 1];
    for arch in
        [Architecture::Qwen3, Architecture::Llama, Architecture::Qwen3Moe, Architecture::DeepseekV3]
    {
        let m = model(arch, 3);
        let policy = on_cpu(&m);
        let mut d = draft(&m, 4);
        let p = params(40, 1);
        let input = groups_of(2, &lens, 5);
        let config = EngineConfig { max_running: 5, ..EngineConfig::default() };
        let plain = Engine::new(&policy, None, config.clone())
            .unwrap()
            .generate(&policy, input.clone(), &p)
            .unwrap();
        // Trained on the policy's continuations, the draft is right often, not always.
        warm_up(&policy, &mut d, &plain.concat(), 8);
        for steps in [1, 3, 6] {
            let config = EngineConfig { speculator: Some(speculator(steps)), ..config.clone() };
            let mut e = spec_engine(&policy, &d, config);
            let spec = e
                .generate_speculative(&policy, Some(&d), input.clone(), &p, &mut |_| Flow::Continue)
                .unwrap();
            assert_eq!(results(&spec), results(&plain), "{arch:?}, {steps} steps");
            let routes = |g: &[Vec<Sample>]| -> Vec<_> {
                g.iter().flatten().map(|s| s.rollout_routed_experts.clone()).collect()
            };
            assert_eq!(routes(&spec), routes(&plain), "{arch:?}, {steps} steps");
            let c = e.stats().spec;
            assert!(c.accepted > c.drafted / 20 && c.accepted < c.drafted, "{arch:?}: {c:?}");
            let s = &spec[0][0];
            assert!(s.metadata["spec_verify_ct"].as_u64().unwrap() > 0, "{}", s.metadata);
        }
        // Preempted and prefilled in chunks: still the plain tokens.
        let per_block = KvCache::bytes_per_block(&m.config, miles_tensor::DType::F32)
            + KvCache::bytes_per_block(&d.config, miles_tensor::DType::F32);
        let tight = EngineConfig {
            kv_cache_bytes: 4 * per_block,
            chunked_prefill_size: Some(20),
            speculator: Some(speculator(3)),
            ..EngineConfig::default()
        };
        // Three samples of prompts that grow past a block each.
        let input = groups_of(3, &[50, 40], 7);
        let plain =
            Engine::new(&policy, None, config).unwrap().generate(&policy, input.clone(), &p);
        let mut e = spec_engine(&policy, &d, tight);
        let spec =
            e.generate_speculative(&policy, Some(&d), input, &p, &mut |_| Flow::Continue).unwrap();
        assert!(e.stats().preemptions > 0, "{:?}", e.stats());
        assert_eq!(results(&spec), results(&plain.unwrap()), "{arch:?}: preempted, chunked");
    }
}

/// Sampled speculative rollouts' logprobs are the scorer's, bit for bit, whatever the
/// packing; the counts add up.
#[test]
fn speculative_logprobs_equal_the_scorers_bit_for_bit() {
    for arch in [
        Architecture::Qwen3,
        Architecture::Gemma2,
        Architecture::Qwen3Moe,
        Architecture::DeepseekV3,
    ] {
        let m = model(arch, 8);
        let policy = on_cpu(&m);
        let d = draft(&m, 9);
        let p = params(30, 0);
        let config =
            EngineConfig { max_running: 5, speculator: Some(speculator(3)), ..Default::default() };
        let mut e = spec_engine(&policy, &d, config);
        let samples = e
            .generate_speculative(&policy, Some(&d), groups_of(3, &[7, 66, 2], 10), &p, &mut |_| {
                Flow::Continue
            })
            .unwrap()
            .concat();
        let seqs: Vec<(Vec<u32>, usize)> =
            samples.iter().map(|s| (s.tokens.clone(), s.prompt_length().unwrap())).collect();
        let (lp, _) = policy.logprobs(&PackedBatch::new(&seqs).unwrap(), p.temperature).unwrap();
        let want: Vec<u32> =
            samples.iter().flat_map(|s| s.rollout_log_probs.iter().map(|v| v.to_bits())).collect();
        let got: Vec<u32> = lp.iter().map(|v| v.to_bits()).collect();
        assert_eq!(got, want, "{arch:?}");
        assert!(samples.iter().all(|s| s.response_length == 30), "{arch:?}");
        let c = e.stats().spec;
        let per_sample: usize = samples
            .iter()
            .map(|s| s.metadata["spec_accept_token_num"].as_u64().unwrap() as usize)
            .sum();
        assert_eq!(per_sample, c.accepted, "{arch:?}");
        assert!(c.accepted <= c.drafted && c.drafted <= 3 * c.verifies, "{arch:?}: {c:?}");
    }
}

/// Pearson's statistic of `counts` against `expected` (cells expected below 5 pooled), and
/// the bound at p = 1e-4 for its degrees of freedom (Wilson–Hilferty).
fn chi_square(counts: &[usize], expected: &[f64]) -> (f64, f64) {
    let (mut stat, mut cells, mut pooled) = (0.0, 0, (0.0, 0.0));
    for (&c, &e) in counts.iter().zip(expected) {
        if e < 5.0 {
            pooled = (pooled.0 + c as f64, pooled.1 + e);
        } else {
            stat += (c as f64 - e).powi(2) / e;
            cells += 1;
        }
    }
    if pooled.1 > 0.0 {
        stat += (pooled.0 - pooled.1).powi(2) / pooled.1;
        cells += 1;
    }
    let df = (cells - 1) as f64;
    let z = 3.719; // the normal's 1 - 1e-4 quantile
    let h = 2.0 / (9.0 * df);
    (stat, df * (1.0 - h + z * h.sqrt()).powi(3))
}

/// Sampled speculative rollouts follow the policy: the first four response tokens (the first
/// drawn at the prefill, the next three by a verification of a chain of two drafts), counted
/// over many samples, against their exact probabilities under the policy (the scorer's logits
/// through the sampler's masses, top-k 3, every path of the tree). Plain sampling passes the
/// same test.
#[test]
fn sampled_speculative_tokens_follow_the_policy() {
    let m = model(Architecture::Qwen3, 21);
    let policy = on_cpu(&m);
    let mut d = draft(&m, 22);
    let mut p = params(4, 3);
    p.temperature = 2.0;
    p.top_p = 1.0;
    let n = 6000;
    let input = groups_of(n, &[9], 23);
    let prompt = input[0][0].tokens.clone();
    let config =
        EngineConfig { max_running: 512, speculator: Some(speculator(2)), ..Default::default() };
    // A draft that proposes well enough that its drafts are often kept and often not.
    let mut warm = p.clone();
    warm.max_new_tokens = 12;
    let own = Engine::new(&policy, None, config.clone())
        .unwrap()
        .generate(&policy, groups_of(64, &[9], 23), &warm)
        .unwrap();
    warm_up(&policy, &mut d, &own[0], 200);
    let mut e = spec_engine(&policy, &d, config.clone());
    let spec = e
        .generate_speculative(&policy, Some(&d), input.clone(), &p, &mut |_| Flow::Continue)
        .unwrap();
    let c = e.stats().spec;
    assert!(c.accepted > c.drafted / 10 && c.accepted < c.drafted, "{c:?}");
    let plain = Engine::new(&policy, None, config).unwrap().generate(&policy, input, &p).unwrap();
    // The tree of every four-token path: the kept masses after each prefix of up to three.
    let masses = |prefix: &[u32]| -> Vec<u64> {
        let tokens = [&prompt[..], prefix].concat();
        let batch = PackedBatch::new(&[(tokens.clone(), tokens.len() - 1)]).unwrap();
        let states = policy.head_states(&policy.forward(&batch, 1.0).unwrap()).unwrap();
        let logits = policy.logits(&states, &[tokens.len() as u32 - 1]).unwrap();
        kept_masses(&logits.to_vec_f32().unwrap(), p.temperature, p.top_k, p.top_p).unwrap()
    };
    let mut paths: Vec<(Vec<u32>, f64)> = vec![(Vec::new(), 1.0)];
    for _ in 0..4 {
        let mut next = Vec::new();
        for (prefix, prob) in paths {
            let w = masses(&prefix);
            let total: u64 = w.iter().sum();
            for (t, &m) in w.iter().enumerate().filter(|(_, m)| **m > 0) {
                let path = [&prefix[..], &[t as u32]].concat();
                next.push((path, prob * m as f64 / total as f64));
            }
        }
        paths = next;
    }
    assert_eq!(paths.len(), 81);
    let expected: Vec<f64> = paths.iter().map(|(_, q)| q * n as f64).collect();
    for (what, samples) in [("speculative", &spec), ("plain", &plain)] {
        let mut counts = vec![0; paths.len()];
        for s in &samples[0] {
            let response = &s.tokens[prompt.len()..];
            let cell = paths.iter().position(|(path, _)| path[..] == *response);
            counts[cell.unwrap_or_else(|| panic!("{what}: {response:?} is not a top-3 path"))] += 1;
        }
        let (stat, bound) = chi_square(&counts, &expected);
        assert!(stat < bound, "{what}: chi-square {stat:.1} above {bound:.1}");
    }
}

/// A draft of another shape, an engine without a scheme, and an engine used without its draft
/// are refused with what to do.
#[test]
fn bad_drafts_and_settings_are_refused() {
    let m = model(Architecture::Qwen3, 1);
    let policy = on_cpu(&m);
    let d = draft(&m, 2);
    let err = |r: miles_core::Result<Engine>| r.err().expect("refused").to_string();
    let other = model(Architecture::Llama, 1);
    let mut wide = presets::preset("tiny", Some(Architecture::Qwen3)).unwrap();
    wide.hidden_size *= 2;
    wide.intermediate_size *= 2;
    let wide = Model::new(wide.clone(), Weights::random(&wide, 1));
    let e = err(Engine::with_draft(&policy, &draft(&wide, 3), None, config(3)));
    assert!(e.contains("hidden size"), "{e}");
    let e = err(Engine::with_draft(&policy, &policy, None, config(3)));
    assert!(e.contains("not an MTP draft"), "{e}");
    let e = err(Engine::with_draft(&policy, &d, None, EngineConfig::default()));
    assert!(e.contains("sglang-speculative-algorithm"), "{e}");
    let mut e = Engine::with_draft(&policy, &d, None, config(3)).unwrap();
    let p = params(4, 0);
    let msg = e.generate(&policy, groups_of(1, &[3], 1), &p).unwrap_err().to_string();
    assert!(msg.contains("generates with its draft"), "{msg}");
    let msg = e
        .generate_speculative(
            &policy,
            Some(&draft(&other, 4)),
            groups_of(1, &[3], 1),
            &p,
            &mut |_| Flow::Continue,
        )
        .unwrap_err()
        .to_string();
    assert!(msg.contains("not the one its draft cache was built for"), "{msg}");
    let mut plain = Engine::new(&policy, None, EngineConfig::default()).unwrap();
    let msg = plain
        .generate_speculative(&policy, Some(&d), groups_of(1, &[3], 1), &p, &mut |_| Flow::Continue)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("built without a draft"), "{msg}");
}

/// The `eagle-spec` plugin's chain of `steps` drafts.
fn speculator(steps: usize) -> Arc<dyn miles_core::Speculator> {
    miles_cli::linked::plugins();
    let config = serde_json::json!({ "num_steps": steps });
    Arc::from(miles_core::registry::create_speculator("eagle-spec", &config).unwrap())
}

fn config(steps: usize) -> EngineConfig {
    EngineConfig { speculator: Some(speculator(steps)), ..EngineConfig::default() }
}

/// `miles generate` speculates with a draft's safetensors: greedy, the plain run's tokens;
/// sampled, rollout logprobs the scorer's bit for bit and the acceptance reported; each
/// speculative flag without its partner is refused by name.
#[test]
fn generate_speculates_with_a_drafts_checkpoint() {
    let dir = miles_tests::scratch("generate_speculative");
    let ckpt = dir.join("ckpt").display().to_string();
    miles_tests::miles(&["init-model", "--preset", "tiny", "--out", &ckpt, "--seed", "3"]).unwrap();
    let config = presets::preset("tiny", None).unwrap();
    let draft_dir = dir.join("draft");
    Draft::random(&config, DraftFormat::DeepSeek, 1).unwrap().save(&draft_dir, &config).unwrap();
    let prompts = dir.join("prompts.jsonl");
    std::fs::write(&prompts, "{\"input\": \"1+1=\"}\n{\"input\": \"a long prompt 7+8=\"}\n")
        .unwrap();
    let draft = draft_dir.display().to_string();
    let spec = ["--sglang-speculative-algorithm", "NEXTN", "--sglang-speculative-draft-model-path"];
    let generate = |name: &str, more: &[&str]| {
        let out = dir.join(name);
        let mut args = vec!["generate", "--hf-checkpoint", &ckpt, "--prompt-data"];
        let (p, o) = (prompts.display().to_string(), out.display().to_string());
        args.extend([p.as_str(), "--n-samples-per-prompt", "4", "--rollout-max-response-len"]);
        args.extend(["16", "--output", o.as_str()]);
        args.extend(more);
        let report = miles_tests::miles(&args)?;
        let samples: Vec<Sample> = std::fs::read_to_string(&out)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        Ok::<_, String>((report, samples))
    };
    let tokens = |s: &[Sample]| s.iter().map(|s| s.tokens.clone()).collect::<Vec<_>>();
    let (_, plain) = generate("plain.jsonl", &["--rollout-top-k", "1"]).unwrap();
    let greedy = [&spec[..], &[&draft, "--rollout-top-k", "1"]].concat();
    let (report, fast) = generate("spec.jsonl", &greedy).unwrap();
    assert_eq!(tokens(&fast), tokens(&plain), "{report}");
    assert!(report.contains("draft tokens accepted"), "{report}");
    let sampled = [&spec[..], &[&draft, "--check-logprobs", "--sglang-speculative-num-steps", "2"]];
    let (report, _) = generate("sampled.jsonl", &sampled.concat()).unwrap();
    assert!(report.contains("bit for bit on 8 of 8 samples"), "{report}");
    for (flags, named) in [
        (&spec[..2], "--sglang-speculative-draft-model-path"),
        (&["--sglang-speculative-draft-model-path", &draft][..], "--sglang-speculative-algorithm"),
        (&["--sglang-speculative-num-steps", "2"][..], "--sglang-speculative-num-steps"),
        (&["--sglang-speculative-algorithm", "EAGLE3"][..], "EAGLE3"),
    ] {
        let e = generate("bad.jsonl", flags).unwrap_err();
        assert!(e.contains(named), "{flags:?}: {e}");
    }
}
