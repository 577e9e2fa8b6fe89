//! The engine over a [`DeviceModel`]: the same scheduler on the device's KV cache, kernels and
//! sampler. On CUDA (through the device bundle) rollout logprobs equal the scorer's bit for
//! bit and a sample's tokens do not depend on its batch, the budget or a preemption; on the
//! CPU's tensor ops (whose products are a reference, not batch-invariant) the same runs agree
//! to rounding.

use miles_core::{Flow, Sample, SamplingParams, Status};
use miles_model::{
    Architecture, DeviceModel, Fp8Layers, KvCache, Model, ModelConfig, PackedBatch, Weights,
    presets,
};
use miles_tensor::cpu::AdamW;
use miles_tensor::rng::Rng;
use miles_tensor::{DType, Device};

use crate::{Engine, EngineConfig};

/// A small model at head_dim 64 (the tensor-core attention's), far from uniform.
fn model(arch: Architecture, seed: u64) -> Model {
    // Heads of 64, the tensor cores' size (DeepSeek's latent heads too: a key per head).
    let mut c: ModelConfig = presets::preset("tiny-h64", Some(arch)).unwrap();
    (c.hidden_size, c.intermediate_size, c.num_hidden_layers) = (256, 512, 2);
    let mut w = Weights::random(&c, seed);
    let mut rng = Rng::new(seed + 100);
    for t in w.tensors_mut() {
        for v in t.iter_mut() {
            *v = if *v == 1.0 { 1.0 + 0.2 * rng.normal() } else { 0.1 * rng.normal() };
        }
    }
    Model::new(c, w)
}

/// Prompt lengths around the 64-token block: shorter, one block, longer, two blocks, one.
fn groups(n: usize, seed: u64, vocab: usize) -> Vec<Vec<Sample>> {
    let mut rng = Rng::new(seed);
    [5usize, 64, 70, 13, 128, 1]
        .iter()
        .enumerate()
        .map(|(g, &len)| {
            let tokens: Vec<u32> = (0..len).map(|_| rng.below(vocab) as u32).collect();
            (0..n)
                .map(|i| Sample {
                    group_index: g,
                    index: g * n + i,
                    tokens: tokens.clone(),
                    ..Sample::default()
                })
                .collect()
        })
        .collect()
}

fn params(max_new: usize) -> SamplingParams {
    SamplingParams {
        temperature: 0.8,
        top_p: 0.95,
        top_k: 50,
        max_new_tokens: max_new,
        ignore_eos: true,
        seed: 7,
        ..SamplingParams::default()
    }
}

/// `m` on `device` and an engine for it.
fn engine(m: &Model, device: &Device, dtype: DType, config: EngineConfig) -> (DeviceModel, Engine) {
    let dm = DeviceModel::new(m, device, dtype).unwrap();
    let e = Engine::new(&dm, None, config).unwrap();
    (dm, e)
}

/// (tokens, logprob bits, status) of every sample, in order.
fn results(groups: &[Vec<Sample>]) -> Vec<(Vec<u32>, Vec<u32>, Status)> {
    groups
        .iter()
        .flatten()
        .map(|s| {
            (s.tokens.clone(), s.rollout_log_probs.iter().map(|v| v.to_bits()).collect(), s.status)
        })
        .collect()
}

fn cuda() -> Option<Device> {
    match Device::Cuda(0).ensure_available() {
        Ok(()) => Some(Device::Cuda(0)),
        Err(e) => {
            println!("skipping CUDA: {e}");
            None
        }
    }
}

/// Each sample's logprobs scored by the device model, packed in `per_batch`es in `order`.
fn score(
    dm: &DeviceModel,
    samples: &[Sample],
    order: &[usize],
    per_batch: usize,
    t: f32,
) -> Vec<Vec<f32>> {
    score_replaying(dm, samples, order, per_batch, t, false)
}

/// [`score`], with `replay`: the experts each sample's record holds replayed (R3; the last
/// token, which no record covers, routes itself).
fn score_replaying(
    dm: &DeviceModel,
    samples: &[Sample],
    order: &[usize],
    per_batch: usize,
    t: f32,
    replay: bool,
) -> Vec<Vec<f32>> {
    let mut by_sample = vec![Vec::new(); samples.len()];
    for chunk in order.chunks(per_batch) {
        let batch: Vec<_> = chunk
            .iter()
            .map(|&i| (samples[i].tokens.clone(), samples[i].prompt_length().unwrap()))
            .collect();
        let mut batch = PackedBatch::new(&batch).unwrap();
        if replay {
            let r = samples[chunk[0]].rollout_routed_experts.as_ref().expect("a record");
            let row = r.num_layers * r.top_k;
            let mut ids = Vec::new();
            for &i in chunk {
                let record = samples[i].rollout_routed_experts.as_ref().expect("a record");
                ids.extend(record.ids.iter().map(|&e| u32::from(e)));
                ids.extend(std::iter::repeat_n(miles_model::moe::OWN_CHOICE, row));
            }
            let (layers, top_k) = (r.num_layers, r.top_k);
            let replay = Some(ids.clone());
            batch.routed = Some(miles_model::RoutedBatch { layers, top_k, ids, replay });
        }
        let (lp, _) = dm.logprobs(&batch, t).unwrap();
        let mut at = 0;
        for &i in chunk {
            let n = samples[i].response_length;
            by_sample[i] = lp[at..at + n].to_vec();
            at += n;
        }
    }
    by_sample
}

/// Test 1 on CUDA: rollout logprobs equal the scorer's bit for bit under several packings,
/// with prefix sharing, continuous batching and top-k/top-p sampling; Qwen3-MoE too (8
/// experts, top-2: every expert in one grouped product per matrix), its samples carrying
/// their routing records; Qwen2's biases, Gemma's sliding windows (8 keys, shorter than the
/// prompts) and Gemma 2's soft-capped scores and logits; DeepSeek-V3's latent attention and
/// grouped routing; the mixtures' scores again with their recorded experts replayed (R3).
#[test]
fn rollout_logprobs_equal_the_device_scorers_bit_for_bit() {
    let Some(device) = cuda() else { return };
    for arch in [
        Architecture::Qwen3,
        Architecture::Llama,
        Architecture::Qwen3Moe,
        Architecture::Qwen2,
        Architecture::Gemma2,
        Architecture::Gemma3,
        Architecture::Glm4,
        Architecture::DeepseekV3,
    ] {
        let m = model(arch, 3);
        let p = params(40);
        let (dm, mut e) = engine(
            &m,
            &device,
            DType::BF16,
            EngineConfig { max_running: 5, ..EngineConfig::default() },
        );
        let samples: Vec<Sample> =
            e.generate(&dm, groups(3, 4, m.config.vocab_size), &p).unwrap().concat();
        for s in &samples {
            let record = s.rollout_routed_experts.as_ref();
            assert_eq!(record.is_some(), m.config.moe.is_some(), "{arch:?}");
            if let Some(r) = record {
                assert_eq!(r.num_tokens().unwrap(), s.tokens.len() - 1);
            }
        }
        let want: Vec<Vec<f32>> = samples.iter().map(|s| s.rollout_log_probs.clone()).collect();
        let forward: Vec<usize> = (0..samples.len()).collect();
        let reversed: Vec<usize> = forward.iter().rev().copied().collect();
        let moe = m.config.moe.is_some();
        for (order, per, what, replay) in [
            (&forward, samples.len(), "one batch", false),
            (&reversed, 5, "reversed by 5", false),
            (&forward, 1, "alone", false),
            (&reversed, 5, "reversed by 5, experts replayed (R3)", moe),
        ] {
            let got = score_replaying(&dm, &samples, order, per, p.temperature, replay);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(g), bits(w), "{arch:?} {what}: sample {i}");
            }
        }
    }
}

/// On CUDA a sample's tokens and logprobs are the same alone, in a batch, under a KV budget
/// that forces preemption, with prompts prefilled in chunks, and continued from a partial
/// response.
#[test]
fn device_samples_do_not_depend_on_the_batch_the_budget_or_a_pause() {
    let Some(device) = cuda() else { return };
    let m = model(Architecture::Qwen3, 5);
    let p = params(70);
    let input = groups(2, 6, m.config.vocab_size);
    let (dm, mut wide) = engine(&m, &device, DType::BF16, EngineConfig::default());
    let want = results(&wide.generate(&dm, input.clone(), &p).unwrap());
    let per_block = KvCache::bytes_per_block(&m.config, DType::BF16);
    let (tight_dm, mut tight) = engine(
        &m,
        &device,
        DType::BF16,
        EngineConfig { kv_cache_bytes: 7 * per_block, ..EngineConfig::default() },
    );
    let got = tight.generate(&tight_dm, input.clone(), &p).unwrap();
    assert_eq!(results(&got), want, "under a tight budget");
    assert!(tight.stats().preemptions > 0, "{:?}", tight.stats());
    let config = EngineConfig { chunked_prefill_size: Some(20), ..EngineConfig::default() };
    let (chunked_dm, mut chunked) = engine(&m, &device, DType::BF16, config);
    let got = chunked.generate(&chunked_dm, input.clone(), &p).unwrap();
    assert_eq!(results(&got), want, "chunked prefill");
    let mut alone = Vec::new();
    for s in input.iter().flatten().rev() {
        alone.push(wide.generate(&dm, vec![vec![s.clone()]], &p).unwrap().remove(0).remove(0));
    }
    alone.reverse();
    assert_eq!(results(&[alone]), want, "alone");
    // Stopped after 30 tokens, then continued to 70.
    let short = SamplingParams { max_new_tokens: 30, ..p.clone() };
    let first = wide.generate(&dm, input.clone(), &short).unwrap();
    let paused: Vec<Vec<Sample>> = first
        .into_iter()
        .map(|g| g.into_iter().map(|s| Sample { status: Status::Aborted, ..s }).collect())
        .collect();
    assert_eq!(results(&wide.generate(&dm, paused, &p).unwrap()), want, "continued");
}

/// The same scheduler over the CPU's tensor ops: samples complete, logprobs agree with the
/// device scorer to rounding, and the budget's preemptions change nothing beyond it.
#[test]
fn the_device_engine_runs_on_cpu_tensors() {
    let m = model(Architecture::Qwen3, 8);
    let p = params(12);
    for dtype in [DType::F32, DType::BF16] {
        // A small cache: the CPU's paged attention reads it whole at every layer.
        let kv_cache_bytes = 40 * KvCache::bytes_per_block(&m.config, dtype);
        let config = EngineConfig { max_running: 4, kv_cache_bytes, ..EngineConfig::default() };
        let (dm, mut e) = engine(&m, &Device::Cpu, dtype, config);
        let samples = e.generate(&dm, groups(2, 9, m.config.vocab_size), &p).unwrap().concat();
        assert!(samples.iter().all(|s| s.status == Status::Truncated && s.response_length == 12));
        let order: Vec<usize> = (0..samples.len()).collect();
        let got = score(&dm, &samples, &order, samples.len(), p.temperature);
        let tol = if dtype == DType::F32 { 1e-4 } else { 0.1 };
        for (s, g) in samples.iter().zip(&got) {
            for (a, b) in s.rollout_log_probs.iter().zip(g) {
                assert!((a - b).abs() <= tol * (1.0 + b.abs()), "{dtype}: {a} vs {b}");
            }
        }
    }
}

/// Greedy decoding (top-k 1) on CUDA follows the argmax of the CPU's logits (f32) wherever
/// the best two are not within bf16's rounding of each other: the kernels compute the model.
#[test]
fn greedy_on_cuda_tracks_the_cpu_model() {
    let Some(device) = cuda() else { return };
    let m = model(Architecture::Llama, 11);
    let greedy = SamplingParams { top_k: 1, top_p: 1.0, temperature: 1.0, ..params(20) };
    let input = groups(1, 12, m.config.vocab_size);
    let (dm, mut e) = engine(&m, &device, DType::BF16, EngineConfig::default());
    let gpu = e.generate(&dm, input.clone(), &greedy).unwrap();
    let (cpu_dm, mut cpu) = engine(&m, &Device::Cpu, DType::F32, EngineConfig::default());
    let want = cpu.generate(&cpu_dm, input, &greedy).unwrap();
    let (mut same, mut total) = (0, 0);
    for (a, b) in gpu.iter().flatten().zip(want.iter().flatten()) {
        let r = a.prompt_length().unwrap();
        // Compare up to the first divergence: later tokens have different contexts.
        for (x, y) in a.tokens[r..].iter().zip(&b.tokens[r..]) {
            total += 1;
            if x != y {
                break;
            }
            same += 1;
        }
    }
    assert!(same * 10 >= total * 8, "greedy tokens agree {same}/{total}");
}

/// SmolLM2-135M's shape (two of its layers): 9 query heads over 3 kv heads, a 49152-token
/// vocabulary, tied head. Rollouts scored by the engine's model and by a second device model
/// made from the same weights (as `miles score` would), bit for bit.
#[test]
fn smollm2_shaped_rollouts_equal_a_fresh_scorer() {
    let Some(device) = cuda() else { return };
    let mut c: ModelConfig = presets::preset("tiny", Some(Architecture::Llama)).unwrap();
    (c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.vocab_size) = (576, 1536, 2, 49152);
    (c.num_attention_heads, c.num_key_value_heads, c.head_dim) = (9, 3, 64);
    (c.rope_theta, c.tie_word_embeddings) = (1e5, true);
    let mut w = Weights::random(&c, 21);
    let mut rng = Rng::new(121);
    for t in w.tensors_mut() {
        for v in t.iter_mut() {
            *v = if *v == 1.0 { 1.0 + 0.2 * rng.normal() } else { 0.05 * rng.normal() };
        }
    }
    let m = Model::new(c, w);
    // 16 prompts × 8 samples through 64 running slots: prefills join decode steps, as in
    // `miles generate` over GSM8K.
    let groups: Vec<Vec<Sample>> = (0..16)
        .map(|g| {
            let prompt: Vec<u32> = (0..90 + g).map(|_| rng.below(49152) as u32).collect();
            (0..8)
                .map(|i| Sample { index: g * 8 + i, tokens: prompt.clone(), ..Sample::default() })
                .collect()
        })
        .collect();
    let p = params(40);
    let (dm, mut e) = engine(&m, &device, DType::BF16, EngineConfig::default());
    let samples = e.generate(&dm, groups, &p).unwrap().concat();
    let fresh = DeviceModel::new(&m, &device, DType::BF16).unwrap();
    let order: Vec<usize> = (0..samples.len()).collect();
    for (what, dm) in [("engine's model", &dm), ("fresh model", &fresh)] {
        let got = score(dm, &samples, &order, samples.len(), p.temperature);
        for (i, (s, g)) in samples.iter().zip(&got).enumerate() {
            let bad: Vec<(usize, f32, f32)> = s
                .rollout_log_probs
                .iter()
                .zip(g)
                .enumerate()
                .filter(|(_, (a, b))| a.to_bits() != b.to_bits())
                .map(|(j, (a, b))| (j, *a, *b))
                .collect();
            assert!(
                bad.is_empty(),
                "{what}: sample {i}: {} positions differ, first {:?}",
                bad.len(),
                &bad[..bad.len().min(3)]
            );
        }
    }
}

/// One AdamW step raising the logprobs of `samples`' responses.
fn train_on(dm: &mut DeviceModel, samples: &[Sample], temperature: f32) {
    let seqs: Vec<_> =
        samples.iter().map(|s| (s.tokens.clone(), s.prompt_length().unwrap())).collect();
    let batch = PackedBatch::new(&seqs).unwrap();
    let fwd = dm.forward(&batch, temperature).unwrap();
    let n = fwd.logp.len();
    dm.zero_grads().unwrap();
    dm.backward(&fwd, &batch, &vec![-1.0 / n as f32; n], &vec![0.0; n]).unwrap();
    drop(fwd);
    let hyper = AdamW { lr: 1e-2, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 };
    dm.adamw_step(&hyper, 1.0).unwrap();
}

/// On CUDA, after an AdamW step in place the same engine's decode steps (captured graphs
/// reading the stacked q/k/v and gate/up copies) follow the new weights, and after new
/// weights set from elsewhere (new compute copies: the graphs are captured again) too: the
/// next rollouts' logprobs equal the scorer's bit for bit.
#[test]
fn rollouts_after_a_training_step_still_equal_the_scorer() {
    let Some(device) = cuda() else { return };
    let m = model(Architecture::Qwen3, 5);
    let p = params(24);
    let vocab = m.config.vocab_size;
    let (mut dm, mut e) = engine(&m, &device, DType::BF16, EngineConfig::default());
    let first = e.generate(&dm, groups(2, 5, vocab), &p).unwrap().concat();
    let buffers = dm.buffers_id();
    train_on(&mut dm, &first, p.temperature);
    assert_eq!(dm.buffers_id(), buffers, "AdamW refreshes the compute copies in place");
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let all = |s: &[Sample]| (0..s.len()).collect::<Vec<_>>();
    let before = score(&dm, &first, &all(&first), first.len(), p.temperature);
    assert!(
        before.iter().zip(&first).any(|(g, s)| bits(g) != bits(&s.rollout_log_probs)),
        "the step changed no logprob"
    );
    let check = |e: &mut Engine, dm: &DeviceModel, seed: u64| {
        let samples = e.generate(dm, groups(2, seed, vocab), &p).unwrap().concat();
        let got = score(dm, &samples, &all(&samples), samples.len(), p.temperature);
        for (i, (g, s)) in got.iter().zip(&samples).enumerate() {
            assert_eq!(bits(g), bits(&s.rollout_log_probs), "seed {seed}: sample {i}");
        }
    };
    check(&mut e, &dm, 6);
    // New weights from elsewhere: new compute copies.
    dm.set_weights(&model(Architecture::Qwen3, 9).weights).unwrap();
    assert_ne!(dm.buffers_id(), buffers);
    check(&mut e, &dm, 7);
    // A model of another shape is refused.
    let mut other = model(Architecture::Qwen3, 9);
    other.config.num_hidden_layers -= 1;
    other.weights = Weights::random(&other.config, 9);
    let other = DeviceModel::new(&other, &device, DType::BF16).unwrap();
    let err = e.generate(&other, groups(1, 8, vocab), &p).unwrap_err().to_string();
    assert!(err.contains("build an engine for that model"), "{err}");
}

/// Unified FP8 on the CPU and on CUDA: the rollout's logprobs equal the scorer's bit for bit
/// (the engine's steps and the training forward read the same E4M3 codes through the same
/// products), before and after an AdamW step requantizes the weights in place; Qwen3 and
/// Qwen3-MoE (its experts in FP8 one by one).
#[test]
fn fp8_rollout_logprobs_equal_the_scorers_bit_for_bit() {
    let mut devices = vec![(Device::Cpu, DType::F32)];
    devices.extend(cuda().map(|d| (d, DType::BF16)));
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let all = |s: &[Sample]| (0..s.len()).collect::<Vec<_>>();
    for (device, dtype) in devices {
        for arch in [Architecture::Qwen3, Architecture::Qwen3Moe] {
            let m = model(arch, 11);
            let p = params(12);
            let vocab = m.config.vocab_size;
            let config = EngineConfig { max_running: 4, ..EngineConfig::default() };
            let (mut dm, mut e) = engine(&m, &device, dtype, config.clone());
            dm.set_fp8(Some(Fp8Layers::default())).unwrap();
            let check = |e: &mut Engine, dm: &DeviceModel, seed: u64| {
                let samples = e.generate(dm, groups(2, seed, vocab), &p).unwrap().concat();
                let reversed: Vec<usize> = all(&samples).into_iter().rev().collect();
                let got = score(dm, &samples, &reversed, 3, p.temperature);
                for (i, (g, s)) in got.iter().zip(&samples).enumerate() {
                    let what = format!("{device} {arch:?} seed {seed}: sample {i}");
                    assert_eq!(bits(g), bits(&s.rollout_log_probs), "{what}");
                }
                samples
            };
            let first = check(&mut e, &dm, 12);
            train_on(&mut dm, &first, p.temperature);
            let after = score(&dm, &first, &all(&first), first.len(), p.temperature);
            assert!(
                after.iter().zip(&first).any(|(g, s)| bits(g) != bits(&s.rollout_log_probs)),
                "{device} {arch:?}: the step changed no logprob"
            );
            check(&mut e, &dm, 13);

            // Rollout-only: the engine's steps read the E4M3 codes and the training forward
            // the compute copies, so the rollout's logprobs are a unified model's, and the
            // scorer's those of the model without FP8.
            let (mut dm, mut e) = engine(&m, &device, dtype, config);
            let unified = Fp8Layers::default();
            dm.set_fp8(Some(Fp8Layers { rollout_only: true, ..unified })).unwrap();
            let mut fp8 = DeviceModel::new(&m, &device, dtype).unwrap();
            fp8.set_fp8(Some(unified)).unwrap();
            let plain = DeviceModel::new(&m, &device, dtype).unwrap();
            let samples = e.generate(&dm, groups(2, 14, vocab), &p).unwrap().concat();
            let order = all(&samples);
            let scores = |dm: &DeviceModel| score(dm, &samples, &order, 3, p.temperature);
            let (in_fp8, own) = (scores(&fp8), scores(&dm));
            assert_eq!(own, scores(&plain), "{device} {arch:?}: rollout-only training forward");
            for (i, s) in samples.iter().enumerate() {
                let what = format!("{device} {arch:?} rollout-only: sample {i}");
                assert_eq!(bits(&in_fp8[i]), bits(&s.rollout_log_probs), "{what}");
            }
            assert!(own.iter().zip(&samples).any(|(g, s)| bits(g) != bits(&s.rollout_log_probs)));
        }
    }
}

/// Test 5 on CUDA: speculative rollouts (a draft fitted on the policy's greedy samples, so
/// it is often right) give the plain engine's greedy tokens and logprobs (its
/// decode steps CUDA graphs), and sampled, logprobs equal to the device scorer's bit for bit.
#[test]
fn speculative_rollouts_on_cuda_keep_the_policys_tokens_and_logprobs() {
    use miles_model::draft::{Draft, DraftFormat, draft_config, fit_draft};
    let Some(device) = cuda() else { return };
    for arch in [Architecture::Qwen3, Architecture::Llama, Architecture::Gemma2] {
        let m = model(arch, 3);
        let vocab = m.config.vocab_size;
        let config = EngineConfig { max_running: 5, ..EngineConfig::default() };
        let (dm, mut plain) = engine(&m, &device, DType::BF16, config.clone());
        let greedy = SamplingParams { top_k: 1, ..params(40) };
        let want = plain.generate(&dm, groups(2, 5, vocab), &greedy).unwrap();
        let pc = &m.config;
        let w = Draft::random(pc, DraftFormat::DeepSeek, 4).unwrap().model_weights(pc, &m.weights);
        let draft = Model::new(draft_config(pc).unwrap(), w.unwrap());
        let mut d = DeviceModel::new(&draft, &device, DType::BF16).unwrap();
        let seqs: Vec<(Vec<u32>, usize)> =
            want.iter().flatten().map(|s| (s.tokens.clone(), s.prompt_length().unwrap())).collect();
        let hyper = AdamW { lr: 1e-2, beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 0.0 };
        fit_draft(&dm, &mut d, &PackedBatch::new(&seqs).unwrap(), 10, &hyper).unwrap();
        let settings = serde_json::json!({ "num_steps": 3 });
        let chain = miles_plugin_eagle_spec::EagleSpec::from_config(&settings).unwrap();
        let speculator = Some(std::sync::Arc::new(chain) as _);
        let spec_config = EngineConfig { speculator, ..config };
        let mut e = Engine::with_draft(&dm, &d, None, spec_config.clone()).unwrap();
        let got = e
            .generate_speculative(&dm, Some(&d), groups(2, 5, vocab), &greedy, &mut |_| {
                Flow::Continue
            })
            .unwrap();
        assert_eq!(results(&got), results(&want), "{arch:?}: greedy");
        let c = e.stats().spec;
        assert!(c.accepted > 0, "{arch:?}: {c:?}");
        let p = params(40);
        let got = e
            .generate_speculative(&dm, Some(&d), groups(2, 6, vocab), &p, &mut |_| Flow::Continue)
            .unwrap();
        // (Whole steps as one graph are opt-in: `whole_speculative_steps_…` below.)
        assert_eq!(e.stats().spec_phases.captured, 0, "{arch:?}");
        let samples = got.concat();
        let order: Vec<usize> = (0..samples.len()).collect();
        let scored = score(&dm, &samples, &order, samples.len(), p.temperature);
        for (i, s) in samples.iter().enumerate() {
            let bits = |v: &[f32]| -> Vec<u32> { v.iter().map(|x| x.to_bits()).collect() };
            assert_eq!(bits(&scored[i]), bits(&s.rollout_log_probs), "{arch:?}: sample {i}");
        }
    }
}

/// Whole speculative steps replayed as one CUDA graph each (`EngineConfig::spec_step_graphs`,
/// opt-in): they are captured (no capture fails), greedy they give the phased steps' tokens
/// and logprob bits, and sampled their logprobs are the device scorer's bit for bit. (Sampled,
/// their tokens are not yet the phased steps': on the H100, 2026-12-07, the Qwen3 case drew
/// another token at one sequence's 6th response position, so the draft's proposals differ
/// between the two paths somewhere; issue 30 keeps it open, and the engine runs phased steps
/// by default.)
#[test]
fn whole_speculative_steps_as_one_graph_keep_the_policys_logprobs() {
    use miles_model::draft::{Draft, DraftFormat, draft_config};
    let Some(device) = cuda() else { return };
    for arch in [Architecture::Qwen3, Architecture::Llama, Architecture::Gemma2] {
        let m = model(arch, 3);
        let vocab = m.config.vocab_size;
        let dm = DeviceModel::new(&m, &device, DType::BF16).unwrap();
        let pc = &m.config;
        let w = Draft::random(pc, DraftFormat::DeepSeek, 4).unwrap().model_weights(pc, &m.weights);
        let draft = Model::new(draft_config(pc).unwrap(), w.unwrap());
        let d = DeviceModel::new(&draft, &device, DType::BF16).unwrap();
        let settings = serde_json::json!({ "num_steps": 3 });
        let chain = miles_plugin_eagle_spec::EagleSpec::from_config(&settings).unwrap();
        let speculator = Some(std::sync::Arc::new(chain) as _);
        let phased = EngineConfig { max_running: 5, speculator, ..EngineConfig::default() };
        let whole = EngineConfig { spec_step_graphs: true, ..phased.clone() };
        let run = |config: EngineConfig, p: &SamplingParams| {
            let mut e = Engine::with_draft(&dm, &d, None, config).unwrap();
            let got = e
                .generate_speculative(&dm, Some(&d), groups(2, 6, vocab), p, &mut |_| {
                    Flow::Continue
                })
                .unwrap();
            (got, e.stats().spec_phases)
        };
        let greedy = SamplingParams { top_k: 1, ..params(40) };
        let (got, phases) = run(whole.clone(), &greedy);
        assert!(phases.captured > 0 && !phases.capture_failed, "{arch:?}: {phases:?}");
        let (want, phases) = run(phased, &greedy);
        assert_eq!(phases.captured, 0);
        assert_eq!(results(&got), results(&want), "{arch:?}: greedy, whole steps against phased");
        let p = params(40);
        let samples = run(whole, &p).0.concat();
        let order: Vec<usize> = (0..samples.len()).collect();
        let scored = score(&dm, &samples, &order, samples.len(), p.temperature);
        for (i, s) in samples.iter().enumerate() {
            let bits = |v: &[f32]| -> Vec<u32> { v.iter().map(|x| x.to_bits()).collect() };
            assert_eq!(bits(&scored[i]), bits(&s.rollout_log_probs), "{arch:?}: sample {i}");
        }
    }
}
