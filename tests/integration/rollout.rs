//! The rollout engine: continuous batching, the paged cache and its budget, stop conditions,
//! and rollout logprobs equal to the scorer's bit for bit.

use miles_core::{Flow, Rollout, Sample, SamplingParams, Status};
use miles_model::testing::on_cpu;
use miles_model::tokenizer::write_byte_level_tokenizer;
use miles_model::{
    Architecture, DeviceModel, KvCache, Model, PackedBatch, Tokenizer, Weights, presets,
};
use miles_rollout::{Engine, EngineConfig};
use miles_tensor::rng::Rng;
#[cfg(feature = "r3")]
use miles_train::batch::{self, TrainSample};

/// A tiny random model whose distributions are far from uniform, so sampling paths differ.
pub(crate) fn model(arch: Architecture, seed: u64) -> Model {
    let config = presets::preset("tiny", Some(arch)).unwrap();
    let mut w = Weights::random(&config, seed);
    perturb(w.tensors_mut(), seed + 100);
    Model::new(config, w)
}

/// Moves random weights away from their initialization (unit norms around 1, the rest wider).
pub(crate) fn perturb(tensors: Vec<&mut Vec<f32>>, seed: u64) {
    let mut rng = Rng::new(seed);
    for t in tensors {
        for v in t.iter_mut() {
            *v = if *v == 1.0 { 1.0 + 0.2 * rng.normal() } else { 0.15 * rng.normal() };
        }
    }
}

fn tokenizer(name: &str) -> Tokenizer {
    let dir = miles_tests::scratch(name);
    write_byte_level_tokenizer(&dir).unwrap();
    Tokenizer::load(&dir).unwrap()
}

/// Prompt lengths around the 64-token block size: shorter, exactly one block, longer.
const PROMPT_LENS: [usize; 6] = [5, 64, 70, 13, 128, 1];

fn groups(n: usize, seed: u64) -> Vec<Vec<Sample>> {
    groups_of(n, &PROMPT_LENS, seed)
}

/// `n` samples of each random prompt of the lengths `lens`, indexed in order.
pub(crate) fn groups_of(n: usize, lens: &[usize], seed: u64) -> Vec<Vec<Sample>> {
    let mut rng = Rng::new(seed);
    lens.iter()
        .enumerate()
        .map(|(g, &len)| {
            let tokens: Vec<u32> = (0..len).map(|_| rng.below(256) as u32).collect();
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
        top_k: 100,
        max_new_tokens: max_new,
        ignore_eos: true,
        seed: 7,
        ..SamplingParams::default()
    }
}

/// A model on the CPU (f32) and an engine for it.
struct Served {
    model: DeviceModel,
    engine: Engine,
}

impl Served {
    fn new(
        m: &Model,
        tokenizer: Option<Tokenizer>,
        config: EngineConfig,
    ) -> miles_core::Result<Self> {
        let model = on_cpu(m);
        let engine = Engine::new(&model, tokenizer, config)?;
        Ok(Served { model, engine })
    }

    fn generate(
        &mut self,
        groups: Vec<Vec<Sample>>,
        params: &SamplingParams,
    ) -> miles_core::Result<Vec<Vec<Sample>>> {
        self.engine.generate(&self.model, groups, params)
    }
}

impl std::ops::Deref for Served {
    type Target = Engine;
    fn deref(&self) -> &Engine {
        &self.engine
    }
}

fn engine(m: &Model, config: EngineConfig) -> Served {
    Served::new(m, None, config).unwrap()
}

fn blocks_mb(m: &Model, blocks: usize) -> usize {
    blocks * KvCache::bytes_per_block(&m.config, miles_tensor::DType::F32)
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

#[test]
fn continuous_batching_gives_each_sample_what_it_gets_alone() {
    let m = model(Architecture::Qwen3, 1);
    let p = params(40);
    let input = groups(3, 2);
    // Few sequences at once: finished ones leave, waiting ones join mid-run.
    let mut small = engine(&m, EngineConfig { max_running: 4, ..EngineConfig::default() });
    let together = small.generate(input.clone(), &p).unwrap();
    assert!(small.stats().steps > 40, "sequences joined late: {:?}", small.stats());
    // Everything at once.
    let mut wide = engine(&m, EngineConfig::default());
    let all = wide.generate(input.clone(), &p).unwrap();
    // Each sample alone, in reverse order.
    let mut alone = Vec::new();
    for s in input.iter().flatten().rev() {
        let mut e = engine(&m, EngineConfig::default());
        alone.push(e.generate(vec![vec![s.clone()]], &p).unwrap().remove(0).remove(0));
    }
    alone.reverse();
    let want = results(&[alone]);
    assert_eq!(results(&together), want);
    assert_eq!(results(&all), want);
    for s in together.iter().flatten() {
        assert_eq!((s.status, s.response_length, s.loss_mask.len()), (Status::Truncated, 40, 40));
    }
    // The samples of one prompt differ from one another (their RNG streams are their own).
    assert_ne!(together[0][0].tokens, together[0][1].tokens);
}

#[test]
fn rollout_logprobs_equal_the_scorers_bit_for_bit() {
    // Gemma 3's sliding window (8) is shorter than most of these sequences.
    for arch in [
        Architecture::Qwen3,
        Architecture::Llama,
        Architecture::Qwen2,
        Architecture::Gemma2,
        Architecture::Gemma3,
        Architecture::Glm4,
        Architecture::DeepseekV3,
    ] {
        let m = model(arch, 3);
        let p = params(30);
        let mut e = engine(&m, EngineConfig { max_running: 5, ..EngineConfig::default() });
        let samples: Vec<Sample> = e.generate(groups(2, 4), &p).unwrap().concat();
        let seqs: Vec<(Vec<u32>, usize)> =
            samples.iter().map(|s| (s.tokens.clone(), s.prompt_length().unwrap())).collect();
        let want: Vec<u32> =
            samples.iter().flat_map(|s| s.rollout_log_probs.iter().map(|v| v.to_bits())).collect();
        // Score under several packings: all together, reversed, in pairs, one by one.
        let score = |order: &[usize], per_batch: usize| -> Vec<u32> {
            let mut by_sample = vec![Vec::new(); samples.len()];
            for chunk in order.chunks(per_batch) {
                let batch: Vec<_> = chunk.iter().map(|&i| seqs[i].clone()).collect();
                let (lp, _) =
                    on_cpu(&m).logprobs(&PackedBatch::new(&batch).unwrap(), p.temperature).unwrap();
                let mut at = 0;
                for &i in chunk {
                    let n = samples[i].response_length;
                    by_sample[i] = lp[at..at + n].iter().map(|v| v.to_bits()).collect();
                    at += n;
                }
            }
            by_sample.concat()
        };
        let forward: Vec<usize> = (0..samples.len()).collect();
        let reversed: Vec<usize> = forward.iter().rev().copied().collect();
        assert_eq!(score(&forward, samples.len()), want, "{arch:?}: one batch");
        assert_eq!(score(&reversed, 5), want, "{arch:?}: reversed, batches of 5");
        assert_eq!(score(&forward, 2), want, "{arch:?}: pairs");
        assert_eq!(score(&reversed, 1), want, "{arch:?}: alone");
    }
}

#[test]
fn the_kv_budget_bounds_the_cache_and_sequences_wait_for_it() {
    let m = model(Architecture::Qwen3, 5);
    let p = params(70);
    let input = groups(2, 6);
    let mut free = engine(&m, EngineConfig::default());
    let want = results(&free.generate(input.clone(), &p).unwrap());
    // 7 blocks: the longest sample (128 + 70 tokens) needs 4 alone, so most must wait and some
    // are preempted and resumed.
    let budget = 7;
    let mut tight = engine(
        &m,
        EngineConfig { kv_cache_bytes: blocks_mb(&m, budget), ..EngineConfig::default() },
    );
    let got = tight.generate(input, &p).unwrap();
    let stats = tight.stats().clone();
    assert_eq!(stats.total_blocks, budget);
    assert!(stats.peak_blocks <= budget, "{stats:?}");
    assert!(stats.preemptions > 0, "the budget should force preemption: {stats:?}");
    assert_eq!(results(&got), want);
    // A sequence that cannot fit even alone fails with the reason instead of hanging.
    let mut tiny =
        engine(&m, EngineConfig { kv_cache_bytes: blocks_mb(&m, 2), ..EngineConfig::default() });
    let out = tiny.generate(groups(1, 6), &p).unwrap().concat();
    let long = &out[4]; // the 128-token prompt
    assert_eq!(long.status, Status::Failed);
    assert!(long.metadata["rollout_error"].as_str().unwrap().contains("--rollout-kv-cache-mb"));
    assert_eq!(out[0].status, Status::Truncated);
}

/// Prompts prefilled in chunks beside the others' decode rows give every sample the tokens and
/// logprob bits of whole prefills, at any chunk size, with or without preemptions.
#[test]
fn chunked_prefill_changes_no_bit() {
    let m = model(Architecture::Qwen3, 13);
    let input = groups(3, 14);
    for max_new in [30, 70] {
        let p = params(max_new);
        let mut whole = engine(&m, EngineConfig { max_running: 7, ..EngineConfig::default() });
        let want = results(&whole.generate(input.clone(), &p).unwrap());
        // Chunk sizes below, at and above a key block; with 70 new tokens, a budget of 7
        // blocks also preempts and resumes sequences.
        let runs: &[(usize, Option<usize>)] = if max_new == 30 {
            &[(1, None), (7, None), (64, None), (100, None)]
        } else {
            &[(20, Some(7))]
        };
        for &(size, blocks) in runs {
            let mut config = EngineConfig {
                max_running: 7,
                chunked_prefill_size: Some(size),
                ..EngineConfig::default()
            };
            if let Some(b) = blocks {
                config.kv_cache_bytes = blocks_mb(&m, b);
            }
            let mut e = engine(&m, config);
            let got = e.generate(input.clone(), &p).unwrap();
            assert_eq!(results(&got), want, "chunks of {size}, budget {blocks:?}");
            if blocks.is_some() {
                assert!(e.stats().preemptions > 0, "{:?}", e.stats());
            }
        }
    }
    let mut zero =
        engine(&m, EngineConfig { chunked_prefill_size: Some(0), ..EngineConfig::default() });
    let err = zero.generate(input, &params(4)).unwrap_err().to_string();
    assert!(err.contains("rollout-chunked-prefill-size"), "{err}");
}

#[test]
fn the_samples_of_a_prompt_share_its_prefill_and_blocks() {
    let m = model(Architecture::Qwen3, 7);
    let n = 8;
    let prompt: Vec<u32> = (0..130).map(|i| (i * 7 % 256) as u32).collect();
    let group: Vec<Sample> =
        (0..n).map(|i| Sample { index: i, tokens: prompt.clone(), ..Sample::default() }).collect();
    let mut e = engine(&m, EngineConfig::default());
    let out = e.generate(vec![group], &params(4)).unwrap();
    let stats = e.stats();
    // The prompt is prefilled once; 3 blocks hold it, 2 of them full and shared by all 8.
    assert_eq!(stats.prefill_tokens, 130);
    assert_eq!(stats.peak_blocks, 2 + n);
    assert_eq!(out[0].len(), n);
}

#[test]
fn stop_conditions_set_the_status() {
    let m = model(Architecture::Llama, 9);
    let tok = tokenizer("rollout-stop");
    let base = params(24);
    let one = |mut p: SamplingParams, config: EngineConfig, prompt_len: usize| -> Sample {
        let mut e = Served::new(&m, Some(tokenizer("rollout-stop-each")), config).unwrap();
        p.seed = 11;
        let s = Sample { tokens: (1..=prompt_len as u32).collect(), ..Sample::default() };
        e.generate(vec![vec![s]], &p).unwrap().remove(0).remove(0)
    };
    let free = one(base.clone(), EngineConfig::default(), 6);
    assert_eq!((free.status, free.response_length), (Status::Truncated, 24));
    // The response text leaves special tokens out, as SGLang's does.
    assert_eq!(free.response, tok.decode(&free.tokens[6..], true).unwrap());
    let response = free.tokens[6..].to_vec();

    // A stop token id: generation ends right after its first occurrence, which is kept.
    let stop_id = response[5];
    let first = response.iter().position(|&t| t == stop_id).unwrap();
    let s = one(
        SamplingParams { stop_token_ids: vec![stop_id], ..base.clone() },
        EngineConfig::default(),
        6,
    );
    assert_eq!((s.status, s.response_length), (Status::Completed, first + 1));
    assert_eq!(s.tokens[6..], response[..first + 1]);
    assert_eq!(s.rollout_log_probs, free.rollout_log_probs[..first + 1]);

    // EOS counts unless ignored.
    let mut m_eos = m.clone();
    m_eos.config.eos_token_ids = vec![stop_id];
    let mut e = engine(&m_eos, EngineConfig::default());
    let s0 = Sample { tokens: (1..=6).collect(), ..Sample::default() };
    let p = SamplingParams { ignore_eos: false, seed: 11, ..base.clone() };
    let s = e.generate(vec![vec![s0]], &p).unwrap().remove(0).remove(0);
    assert_eq!((s.status, s.response_length), (Status::Completed, first + 1));

    // A stop string: ends at the first token whose text completes it.
    let text = tok.decode(&response[8..10], false).unwrap();
    let s = one(
        SamplingParams { stop: vec![text.clone()], ..base.clone() },
        EngineConfig::default(),
        6,
    );
    assert_eq!(s.status, Status::Completed);
    let full_text = tok.decode(&s.tokens[6..], false).unwrap();
    assert!(full_text.contains(&text) && s.response_length <= 10, "{full_text:?}");
    assert!(!tok.decode(&s.tokens[6..s.tokens.len() - 1], false).unwrap().contains(&text));

    // Too-long prompts are skipped with the reason; the others still run.
    let mut e = engine(&m, EngineConfig { max_prompt_len: Some(8), ..EngineConfig::default() });
    let long = Sample { tokens: (1..=9).collect(), ..Sample::default() };
    let short = Sample { index: 1, tokens: (1..=8).collect(), ..Sample::default() };
    let out = e.generate(vec![vec![long], vec![short]], &base).unwrap();
    assert_eq!(out[0][0].status, Status::Failed);
    let reason = out[0][0].metadata["rollout_error"].as_str().unwrap();
    assert!(reason.contains("--rollout-max-prompt-len 8"), "{reason}");
    assert_eq!((out[1][0].status, out[1][0].response_length), (Status::Truncated, 24));
    assert_eq!(e.stats().skipped_prompts, 1);
}

#[test]
fn bad_sampling_flags_are_errors() {
    let m = model(Architecture::Qwen3, 1);
    let mut e = engine(&m, EngineConfig::default());
    let g = groups(1, 1);
    for (p, flag) in [
        (SamplingParams { temperature: 0.0, ..params(4) }, "--rollout-temperature"),
        (SamplingParams { top_p: 1.5, ..params(4) }, "--rollout-top-p"),
        (SamplingParams { max_new_tokens: 0, ..params(4) }, "--rollout-max-response-len"),
    ] {
        let err = e.generate(g.clone(), &p).unwrap_err().to_string();
        assert!(err.starts_with(flag), "{err}");
    }
    let err = Served::new(&m, None, EngineConfig { kv_cache_bytes: 10, ..EngineConfig::default() });
    assert!(err.err().unwrap().to_string().contains("--rollout-kv-cache-mb"));
}

/// A scratch directory `name` with a random tiny checkpoint in `ckpt/`, made with `seed`.
fn scratch_checkpoint(name: &str, seed: &str) -> (std::path::PathBuf, String) {
    let dir = miles_tests::scratch(name);
    let ckpt = dir.join("ckpt").display().to_string();
    miles_tests::miles(&["init-model", "--preset", "tiny", "--out", &ckpt, "--seed", seed])
        .unwrap();
    (dir, ckpt)
}

/// `miles generate` on a checkpoint, then `miles score` on its output: valid samples whose
/// rollout logprobs the scorer reproduces exactly.
#[test]
fn generate_writes_samples_that_score_reproduces() {
    let (dir, ckpt) = scratch_checkpoint("generate_cli", "5");
    let ckpt_s = ckpt.as_str();
    let prompts = dir.join("prompts.jsonl");
    std::fs::write(
        &prompts,
        concat!(
            r#"{"question": "What is 2 + 3?", "answer": 5}"#,
            "\n",
            "\n",
            r#"{"question": [{"role": "user", "content": "Name a colour."}], "answer": "red"}"#,
            "\n",
            r#"{"question": "Skipped by the slice", "answer": 0}"#,
            "\n",
        ),
    )
    .unwrap();
    let out = dir.join("samples.jsonl");
    let data = format!("{}@[0:2]", prompts.display());
    let report = miles_tests::miles(&[
        "generate",
        "--hf-checkpoint",
        ckpt_s,
        "--prompt-data",
        &data,
        "--input-key",
        "question",
        "--label-key",
        "answer",
        "--apply-chat-template",
        "--n-samples-per-prompt",
        "3",
        "--rollout-max-response-len",
        "12",
        "--rollout-temperature",
        "0.9",
        "--rollout-top-p",
        "0.9",
        "--output",
        out.to_str().unwrap(),
        "--check-logprobs",
    ])
    .unwrap();
    assert!(report.contains("generated 6 samples") && report.contains("tokens/s"), "{report}");
    assert!(report.contains("bit for bit on 6 of 6 samples"), "{report}");
    let text = std::fs::read_to_string(&out).unwrap();
    let samples: Vec<Sample> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(samples.len(), 6);
    for (i, s) in samples.iter().enumerate() {
        assert_eq!((s.group_index, s.index), (i / 3, i));
        assert!(matches!(s.status, Status::Completed | Status::Truncated), "{s:?}");
        assert_eq!(s.rollout_log_probs.len(), s.response_length);
        assert_eq!(s.loss_mask.len(), s.response_length);
        assert!(s.response_length >= 1 && s.response_length <= 12);
    }
    assert_eq!(samples[0].label.as_deref(), Some("5"));
    assert_eq!(samples[5].label.as_deref(), Some("red"));

    let scored = miles_tests::miles(&[
        "score",
        "--hf-checkpoint",
        ckpt_s,
        "--input",
        out.to_str().unwrap(),
        "--rollout-temperature",
        "0.9",
    ])
    .unwrap();
    for ((row, line), s) in scored.lines().zip(text.lines()).zip(&samples) {
        let row: serde_json::Value = serde_json::from_str(row).unwrap();
        let lp: Vec<f32> = serde_json::from_value(row["log_probs"].clone()).unwrap();
        assert_eq!(lp, s.rollout_log_probs, "sample {}", s.index);
        // Written alike too: a reader parsing the numbers as f64 (Python) finds them equal.
        let written: serde_json::Value = serde_json::from_str(line).unwrap();
        assert_eq!(row["log_probs"], written["rollout_log_probs"], "sample {}", s.index);
    }

    // Bad input names the file, the line and the flag.
    let err = miles_tests::miles(&[
        "generate",
        "--hf-checkpoint",
        ckpt_s,
        "--prompt-data",
        prompts.to_str().unwrap(),
        "--input-key",
        "prompt",
        "--output",
        out.to_str().unwrap(),
    ])
    .unwrap_err()
    .to_string();
    assert!(err.contains("prompts.jsonl:1") && err.contains("--input-key"), "{err}");
    let err = miles_tests::miles(&[
        "generate",
        "--hf-checkpoint",
        ckpt_s,
        "--prompt-data",
        &format!("{}@[0:x]", prompts.display()),
        "--output",
        out.to_str().unwrap(),
    ])
    .unwrap_err()
    .to_string();
    assert!(err.contains("FILE@[a:b]"), "{err}");
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// Progress hands over every group once, when its last sample is final, with the samples the
/// call returns; a group with nothing to generate (a prompt too long) comes too.
#[test]
fn progress_hands_over_each_group_once_when_it_is_done() {
    let m = model(Architecture::Qwen3, 3);
    // The prompt of 128 tokens (group 4) is skipped.
    let config =
        EngineConfig { max_running: 3, max_prompt_len: Some(100), ..EngineConfig::default() };
    let mut e = engine(&m, config);
    let input = groups(2, 8);
    let mut seen: Vec<(usize, Vec<Sample>)> = Vec::new();
    let mut reports = 0;
    let out = e
        .engine
        .generate_with_progress(&e.model, input, &params(10), &mut |p| {
            reports += 1;
            assert!(p.blocks_used <= p.total_blocks && p.finished <= p.total);
            seen.extend(p.groups_done.iter().map(|(g, s)| (*g, s.to_vec())));
            Flow::Continue
        })
        .unwrap();
    assert!(reports > 1);
    seen.sort_by_key(|(g, _)| *g);
    let groups: Vec<usize> = seen.iter().map(|(g, _)| *g).collect();
    assert_eq!(groups, (0..6).collect::<Vec<_>>());
    for (g, samples) in seen {
        assert_eq!(samples, out[g], "group {g}");
    }
    assert!(out[4].iter().all(|s| s.status == Status::Failed));
}

/// `miles generate` writes each prompt's samples as they finish: killed (-9) mid-run, or cut
/// short in the middle of a line, `--resume` keeps the complete prompts, generates the others
/// and ends with the file one uninterrupted run writes, byte for byte.
#[test]
fn a_killed_generate_keeps_its_samples_and_resumes_exactly() {
    let (dir, ckpt) = scratch_checkpoint("generate_resume", "7");
    let ckpt_s = ckpt.as_str();
    let prompts = dir.join("prompts.jsonl");
    let lines: String = (0..12).map(|i| format!("{{\"input\": \"{i} + {i} =\"}}\n")).collect();
    std::fs::write(&prompts, lines).unwrap();
    let args = |out: &std::path::Path| -> Vec<String> {
        let mut a: Vec<String> =
            ["generate", "--hf-checkpoint", ckpt_s, "--prompt-data"].map(String::from).to_vec();
        a.push(prompts.display().to_string());
        for flag in ["--n-samples-per-prompt 2", "--rollout-max-response-len 48"] {
            a.extend(flag.split(' ').map(String::from));
        }
        a.extend(["--rollout-max-running", "2", "--output"].map(String::from));
        a.push(out.display().to_string());
        a
    };
    let full = dir.join("full.jsonl");
    miles_tests::miles(&strs(&args(&full))).unwrap();
    let want = std::fs::read_to_string(&full).unwrap();
    assert_eq!(want.lines().count(), 24);

    // Killed as soon as the first samples are on disk.
    let out = dir.join("killed.jsonl");
    let mut child = std::process::Command::new(miles_tests::miles_binary())
        .args(args(&out))
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let start = std::time::Instant::now();
    while std::fs::read_to_string(&out).map_or(0, |t| t.lines().count()) < 2
        && child.try_wait().unwrap().is_none()
        && start.elapsed().as_secs() < 60
    {
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    child.kill().ok();
    child.wait().unwrap();
    let kept = std::fs::read_to_string(&out).unwrap();
    assert!(kept.lines().count() >= 2, "the killed run kept its finished samples");
    let mut resume = args(&out);
    resume.push("--resume".into());
    let report = miles_tests::miles(&strs(&resume)).unwrap();
    assert!(report.contains("wrote 24 samples"), "{report}");
    assert_eq!(std::fs::read_to_string(&out).unwrap(), want);

    // Cut in the middle of a line, one prompt half written: both are generated again.
    let cut: String = want.lines().take(3).map(|l| format!("{l}\n")).collect();
    let fourth = want.lines().nth(3).unwrap();
    std::fs::write(&out, format!("{cut}{}", &fourth[..fourth.len() / 2])).unwrap();
    let report = miles_tests::miles(&strs(&resume)).unwrap();
    assert!(report.contains("generated 22 samples"), "{report}");
    assert_eq!(std::fs::read_to_string(&out).unwrap(), want);
}

#[test]
fn an_aborted_partial_response_is_continued_exactly() {
    let m = model(Architecture::Qwen3, 13);
    let p = params(20);
    let mut e = engine(&m, EngineConfig::default());
    let full = e.generate(groups(1, 14), &p).unwrap().concat();
    let partial: Vec<Vec<Sample>> = full
        .iter()
        .map(|s| {
            let keep = 1 + s.index % 10;
            let cut = s.response_length - keep;
            let mut s = s.clone();
            s.tokens.truncate(s.tokens.len() - cut);
            s.rollout_log_probs.truncate(keep);
            s.response_length = keep;
            s.status = Status::Aborted;
            vec![s]
        })
        .collect();
    let resumed = e.generate(partial, &p).unwrap().concat();
    assert_eq!(results(&[resumed]), results(&[full]));
}

/// A caller that has enough aborts the call: the samples still running end `Aborted` where
/// they are (a prefix of what they would have generated, with its logprobs), those never
/// admitted unchanged, the finished groups as they were; continued, every sample ends as in
/// the call never aborted, bit for bit.
#[test]
fn an_aborted_call_ends_its_samples_where_they_are_and_they_continue_exactly() {
    let m = model(Architecture::Qwen3, 13);
    let p = params(20);
    // Prompts admitted one a step, three at most running: the first ends while others run
    // and others wait.
    let config = EngineConfig { max_running: 3, max_prefill_tokens: 64, ..EngineConfig::default() };
    let mut e = engine(&m, config);
    let full = e.generate(groups(1, 21), &p).unwrap();
    let mut done = Vec::new();
    let served = &mut e;
    let out = {
        let mut rollout = served.engine.lend(&served.model);
        rollout
            .generate_until(groups(1, 21), &p, &mut |g, samples| {
                done.push((g, samples.to_vec()));
                Flow::Abort
            })
            .unwrap()
    };
    assert_eq!(done.len(), 1, "{done:?}");
    let (first, samples) = &done[0];
    assert_eq!((samples, &out[*first]), (&full[*first], &full[*first]));
    let aborted: Vec<&Sample> =
        out.iter().flatten().filter(|s| s.status == Status::Aborted).collect();
    assert_eq!(e.stats().aborted, aborted.len());
    assert!(aborted.iter().any(|s| s.response_length == 0), "none was waiting");
    for s in &aborted {
        let whole = &full[s.group_index][0];
        assert_eq!(s.rollout_log_probs.len(), s.response_length);
        assert_eq!(s.loss_mask.len(), s.response_length);
        assert_eq!(s.tokens[..], whole.tokens[..s.tokens.len()], "sample {}", s.index);
        assert_eq!(s.rollout_log_probs[..], whole.rollout_log_probs[..s.response_length]);
    }
    let resumed = e.generate(out, &p).unwrap();
    assert_eq!(results(&resumed), results(&full));
}

/// A serving engine takes requests as they come, from many threads at once: those with the
/// running ones' sampling parameters join them between steps, the others wait their turn, a
/// request with bad parameters gets its error; each comes back as `generate` gives the same
/// samples (numbered in arrival order), and the engine stops when the last sender is gone.
#[test]
fn a_serving_engine_batches_requests_as_they_come() {
    let m = model(Architecture::Qwen3, 13);
    let p = params(12);
    let mut e = engine(&m, EngineConfig { max_running: 4, ..EngineConfig::default() });
    let prompt = groups_of(1, &[9], 5).concat().remove(0);
    let (tx, rx) = std::sync::mpsc::channel::<miles_rollout::Job>();
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    std::thread::scope(|scope| {
        let served = &mut e;
        scope.spawn(move || served.engine.serve(&mut served.model, &rx).unwrap());
        for _ in 0..12 {
            let (tx, done_tx, group) = (tx.clone(), done_tx.clone(), vec![prompt.clone()]);
            let p = p.clone();
            scope.spawn(move || {
                let reply = Box::new(move |r| done_tx.send(r).unwrap());
                let request =
                    miles_rollout::Request { group, params: p, reply, rid: None, key: None };
                tx.send(miles_rollout::Job::Generate(request)).unwrap();
            });
        }
        for other in [SamplingParams { temperature: -1.0, ..p.clone() }, params(5)] {
            let done_tx = done_tx.clone();
            let reply = Box::new(move |r| done_tx.send(r).unwrap());
            let group = vec![prompt.clone()];
            let request =
                miles_rollout::Request { group, params: other, reply, rid: None, key: None };
            tx.send(miles_rollout::Job::Generate(request)).unwrap();
        }
        drop((tx, done_tx));
    });
    let mut answers: Vec<miles_core::Result<Vec<Sample>>> = done_rx.iter().collect();
    assert_eq!(answers.len(), 14);
    // The request with other parameters: served in a turn of its own, with them.
    let short = answers.iter().position(|a| a.as_ref().is_ok_and(|s| s[0].response_length == 5));
    let _served = answers.remove(short.expect("the 5-token request was not served"));
    let errors: Vec<String> =
        answers.iter().filter_map(|a| a.as_ref().err()).map(|e| e.to_string()).collect();
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(errors[0].contains("temperature"), "{errors:?}");
    // Each served sample is what `generate` gives that prompt under the index it was given
    // (the arrival order numbers them), bit for bit.
    let served: Vec<Vec<Sample>> = answers.into_iter().filter_map(Result::ok).collect();
    assert_eq!(served.len(), 12);
    let numbered: Vec<Vec<Sample>> =
        served.iter().map(|g| vec![Sample { index: g[0].index, ..prompt.clone() }]).collect();
    assert_eq!(results(&served), results(&e.generate(numbered, &p).unwrap()));
}

/// `Job::Abort` (SGLang's `/abort_request`): a running request named by its `rid` ends at
/// once, `Aborted`, its blocks freed; a queued one (other sampling parameters) goes back
/// `Aborted` without running; the others are served as `generate` serves them, bit for bit.
#[test]
fn a_serving_engine_aborts_requests_by_name() {
    use miles_rollout::{Job, Request};
    let m = model(Architecture::Qwen3, 17);
    let p = params(12);
    let mut e = engine(&m, EngineConfig { max_running: 4, ..EngineConfig::default() });
    let prompt = groups_of(1, &[7], 6).concat().remove(0);
    let (tx, rx) = std::sync::mpsc::channel::<Job>();
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let request = |rid: &str, params: &SamplingParams| {
        let (done_tx, name) = (done_tx.clone(), rid.to_string());
        let reply = Box::new(move |r| done_tx.send((name, r)).unwrap());
        let group = vec![prompt.clone(), prompt.clone()];
        let rid = Some(rid.into());
        Job::Generate(Request { group, params: params.clone(), reply, rid, key: None })
    };
    // All queued before the engine starts: "running" is taken first, with "kept"; the
    // abort reaches the engine at its first intake, before any step.
    tx.send(request("running", &p)).unwrap();
    tx.send(request("kept", &p)).unwrap();
    tx.send(request("queued", &params(5))).unwrap();
    tx.send(Job::Abort { rid: Some("running".into()) }).unwrap();
    tx.send(Job::Abort { rid: Some("queued".into()) }).unwrap();
    tx.send(Job::Abort { rid: Some("nobody".into()) }).unwrap();
    drop((tx, done_tx));
    e.engine.serve(&mut e.model, &rx).unwrap();
    let answers: std::collections::HashMap<String, Vec<Sample>> =
        done_rx.iter().map(|(rid, r)| (rid, r.unwrap())).collect();
    assert_eq!(answers.len(), 3);
    for rid in ["running", "queued"] {
        let samples = &answers[rid];
        assert!(samples.iter().all(|s| s.status == Status::Aborted), "{rid}: {samples:?}");
        assert!(samples.iter().all(|s| s.response_length == 0), "{rid}");
    }
    let kept = &answers["kept"];
    assert!(kept.iter().all(|s| s.status != Status::Aborted && s.response_length > 0));
    let numbered: Vec<Vec<Sample>> =
        vec![kept.iter().map(|s| Sample { index: s.index, ..prompt.clone() }).collect()];
    assert_eq!(results(std::slice::from_ref(kept)), results(&e.generate(numbered, &p).unwrap()));
    assert_eq!(e.engine.stats().aborted, 2);

    // abort_all: the running request and a queued one alike.
    let (tx, rx) = std::sync::mpsc::channel::<Job>();
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    for params in [p.clone(), params(5)] {
        let done_tx = done_tx.clone();
        let reply = Box::new(move |r| done_tx.send(r).unwrap());
        let group = vec![prompt.clone()];
        tx.send(Job::Generate(Request { group, params, reply, rid: None, key: None })).unwrap();
    }
    tx.send(Job::Abort { rid: None }).unwrap();
    drop((tx, done_tx));
    e.engine.serve(&mut e.model, &rx).unwrap();
    let answers: Vec<miles_core::Result<Vec<Sample>>> = done_rx.iter().collect();
    assert_eq!(answers.len(), 2);
    for r in answers {
        assert!(r.unwrap().iter().all(|s| s.status == Status::Aborted));
    }
}

/// Regressions found in review: the sequence cap holds for groups, duplicate indices and empty
/// stop strings are refused, a resumed response keeps its loss mask, a model of another shape
/// is refused, an impossible KV budget is an error.
#[test]
fn engine_limits_and_refusals() {
    let m = model(Architecture::Qwen3, 21);
    let mut e = engine(&m, EngineConfig { max_running: 3, ..EngineConfig::default() });
    let out = e.generate(groups(8, 22), &params(6)).unwrap();
    assert!(e.stats().peak_running <= 3, "{:?}", e.stats());
    assert!(out.iter().flatten().all(|s| s.status == Status::Truncated));

    let twins = vec![vec![Sample { tokens: vec![1, 2], ..Sample::default() }; 2]];
    let err = e.generate(twins, &params(4)).unwrap_err().to_string();
    assert!(err.contains("index 0"), "{err}");
    let p = SamplingParams { stop: vec![String::new()], ..params(4) };
    assert!(e.generate(groups(1, 1), &p).unwrap_err().to_string().starts_with("--rollout-stop"));
    let p = SamplingParams { stop: vec!["x".into()], ..params(4) };
    let err = e.generate(groups(1, 1), &p).unwrap_err().to_string();
    assert!(err.contains("tokenizer"), "{err}");

    // Resuming keeps the earlier part's mask.
    let full = e.generate(groups(1, 23), &params(8)).unwrap().remove(0).remove(0);
    let mut part = full.clone();
    part.tokens.truncate(full.tokens.len() - 4);
    part.rollout_log_probs.truncate(4);
    part.response_length = 4;
    part.loss_mask = vec![1, 0, 0, 1];
    part.status = Status::Aborted;
    let resumed = e.generate(vec![vec![part]], &params(8)).unwrap().remove(0).remove(0);
    assert_eq!(resumed.tokens, full.tokens);
    assert_eq!(resumed.loss_mask, vec![1, 0, 0, 1, 1, 1, 1, 1]);
    // A partial response that already ends in a stop token is complete as it is.
    let mut ended = full.clone();
    ended.tokens.truncate(full.tokens.len() - 4);
    ended.rollout_log_probs.truncate(4);
    ended.response_length = 4;
    ended.status = Status::Aborted;
    let stop = SamplingParams { stop_token_ids: vec![*ended.tokens.last().unwrap()], ..params(8) };
    let done = e.generate(vec![vec![ended.clone()]], &stop).unwrap().remove(0).remove(0);
    assert_eq!((done.status, &done.tokens), (Status::Completed, &ended.tokens));

    // A model of another shape, lent to this engine, is refused and changes nothing.
    let other = on_cpu(&Model::new(
        presets::preset("tiny", Some(Architecture::Llama)).unwrap(),
        Weights::random(&presets::preset("tiny", Some(Architecture::Llama)).unwrap(), 1),
    ));
    let err = e.engine.generate(&other, groups(1, 23), &params(8)).unwrap_err().to_string();
    assert!(err.contains("build an engine for that model"), "{err}");
    let again = e.generate(groups(1, 23), &params(8)).unwrap().remove(0).remove(0);
    assert_eq!(again.tokens, full.tokens);

    // The trainer's weight sync: the model changes where it is, the next samples are drawn
    // from it and carry the next policy version; the same weights in a fresh model sample the
    // same.
    let mut w = e.model.to_weights().unwrap();
    w.final_norm.iter_mut().for_each(|w| *w *= 3.0);
    e.model.set_weights(&w).unwrap();
    e.engine.weights_updated();
    assert_eq!(e.weight_version(), 1);
    let changed = e.generate(groups(1, 23), &params(8)).unwrap().remove(0).remove(0);
    assert_ne!(changed.rollout_log_probs, full.rollout_log_probs);
    assert_eq!(changed.weight_version, 1);
    let mut fresh = engine(&Model::new(m.config.clone(), w), EngineConfig::default());
    let same = fresh.generate(groups(1, 23), &params(8)).unwrap().remove(0).remove(0);
    assert_eq!(same.rollout_log_probs, changed.rollout_log_probs);

    let huge = EngineConfig { kv_cache_bytes: 1 << 60, ..EngineConfig::default() };
    let err = Served::new(&m, None, huge).err().unwrap().to_string();
    assert!(err.contains("--rollout-kv-cache-mb"), "{err}");
}

/// The samples as the trainer packs them (routing records included), with `replay` through
/// the `r3` plugin.
#[cfg(feature = "r3")]
fn packed(samples: &[Sample], replay: bool) -> PackedBatch {
    miles_cli::linked::plugins();
    let r3 = miles_core::registry::create_replay("r3", &serde_json::json!({})).unwrap();
    let train: Vec<TrainSample> = samples
        .iter()
        .map(|s| {
            let mut t = TrainSample::from_sample(s, 0, 0.0).unwrap();
            if replay {
                let record = t.routed_experts.as_ref().unwrap();
                t.replay_experts = Some(r3.replay(record, t.tokens.len()).unwrap());
            }
            t
        })
        .collect();
    batch::pack(&train).unwrap()
}

/// A Qwen3-MoE or DeepSeek-V3 rollout records each position's experts (every position but
/// the last, every sparse layer, top-k each), the same under preemption and chunked prefill;
/// the trainer's forward picks the same experts and gives the rollout's logprobs bit for bit,
/// and replaying the record (R3) changes no bit where they already agree.
#[cfg(feature = "r3")]
#[test]
fn moe_rollouts_record_their_experts_and_equal_the_trainer() {
    for arch in [Architecture::Qwen3Moe, Architecture::DeepseekV3] {
        moe_rollouts_record_their_experts(arch);
    }
}

#[cfg(feature = "r3")]
fn moe_rollouts_record_their_experts(arch: Architecture) {
    let m = model(arch, 17);
    let c = &m.config;
    let sparse = (0..c.num_hidden_layers).filter(|&l| c.is_sparse_layer(l)).count();
    let p = params(70);
    let input = groups(3, 18);
    let mut e = engine(&m, EngineConfig { max_running: 5, ..EngineConfig::default() });
    let samples = e.generate(input.clone(), &p).unwrap().concat();
    let config = EngineConfig {
        chunked_prefill_size: Some(20),
        kv_cache_bytes: blocks_mb(&m, 7),
        ..EngineConfig::default()
    };
    let mut tight = engine(&m, config);
    let again = tight.generate(input, &p).unwrap().concat();
    assert!(tight.stats().preemptions > 0, "{:?}", tight.stats());
    for (s, t) in samples.iter().zip(&again) {
        let r = s.rollout_routed_experts.as_ref().expect("a routing record");
        assert_eq!((r.num_layers, r.top_k), (sparse, 2), "{arch:?}");
        assert_eq!(r.num_tokens().unwrap(), s.tokens.len() - 1);
        assert!(r.ids.iter().all(|&x| x < 8));
        assert_eq!(s.rollout_routed_experts, t.rollout_routed_experts, "preempted, chunked");
        assert_eq!(s.tokens, t.tokens);
    }
    let want: Vec<u32> =
        samples.iter().flat_map(|s| s.rollout_log_probs.iter().map(|v| v.to_bits())).collect();
    let recorded: usize = samples.iter().map(|s| (s.tokens.len() - 1) * sparse).sum();
    for replay in [false, true] {
        let f = on_cpu(&m).forward(&packed(&samples, replay), p.temperature).unwrap();
        let bits: Vec<u32> = f.logp.iter().map(|v| v.to_bits()).collect();
        assert_eq!(bits, want, "{arch:?}: replay {replay}");
        let mismatch = f.sparse.routing_mismatch.unwrap();
        assert_eq!(
            (mismatch.compared, mismatch.own_differs, mismatch.used_differs),
            (recorded, 0, 0)
        );
    }
}

/// R3 does its job: with the training copy's router moved a little, the trainer's own top-k
/// differs from the rollout's record for some tokens; replaying the record makes every expert
/// set identical again and brings the trainer's logprobs closer to the rollout's.
#[cfg(feature = "r3")]
#[test]
fn routing_replay_restores_the_rollouts_experts_under_a_perturbed_router() {
    let rollout = model(Architecture::Qwen3Moe, 21);
    let samples = engine(&rollout, EngineConfig::default())
        .generate(groups(2, 22), &params(30))
        .unwrap()
        .concat();
    let mut training = rollout.clone();
    let mut rng = Rng::new(23);
    for layer in &mut training.weights.layers {
        layer.router.iter_mut().for_each(|w| *w += 0.01 * rng.normal());
    }
    let temperature = params(30).temperature;
    let gap = |f: &miles_model::Forward| -> f32 {
        let rollout_lp = samples.iter().flat_map(|s| s.rollout_log_probs.iter());
        f.logp.iter().zip(rollout_lp).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max)
    };
    let free = on_cpu(&training).forward(&packed(&samples, false), temperature).unwrap();
    let replayed = on_cpu(&training).forward(&packed(&samples, true), temperature).unwrap();
    let (a, b) = (free.sparse.routing_mismatch.unwrap(), replayed.sparse.routing_mismatch.unwrap());
    assert!(a.own_differs > 0, "the perturbation changed no choice: {a:?}");
    assert_eq!(a.used_differs, a.own_differs, "without replay the trainer uses its own");
    // Replayed, every expert set is the rollout's (the trainer's own choices, downstream of
    // the replayed layers, still differ).
    assert!(b.used_differs == 0 && b.own_differs > 0, "{b:?}");
    assert!(gap(&replayed) < gap(&free), "replayed {} vs free {}", gap(&replayed), gap(&free));
}

/// `miles generate` on a Qwen3-MoE checkpoint writes each sample's routing record, and
/// `miles score --routed-experts` reports the same experts and the same logprobs.
#[test]
fn generate_records_experts_that_score_reports() {
    let dir = miles_tests::scratch("generate_moe_cli");
    let ckpt = dir.join("ckpt");
    let ckpt_s = ckpt.to_str().unwrap();
    let init = ["init-model", "--arch", "qwen3-moe", "--out", ckpt_s, "--seed", "6"];
    miles_tests::miles(&init).unwrap();
    let prompts = dir.join("prompts.jsonl");
    std::fs::write(&prompts, "{\"input\": \"7+8=\"}\n{\"input\": \"a longer prompt, 3+4=\"}\n")
        .unwrap();
    let out = dir.join("samples.jsonl");
    let prompt_data = prompts.to_str().unwrap();
    let out_s = out.to_str().unwrap();
    miles_tests::miles(&[
        "generate",
        "--hf-checkpoint",
        ckpt_s,
        "--prompt-data",
        prompt_data,
        "--n-samples-per-prompt",
        "2",
        "--rollout-max-response-len",
        "9",
        "--output",
        out_s,
    ])
    .unwrap();
    let text = std::fs::read_to_string(&out).unwrap();
    let samples: Vec<Sample> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let scored = miles_tests::miles(&[
        "score",
        "--hf-checkpoint",
        ckpt_s,
        "--input",
        out_s,
        "--routed-experts",
    ])
    .unwrap();
    assert_eq!(scored.lines().count(), 4);
    for (row, s) in scored.lines().zip(&samples) {
        let row: serde_json::Value = serde_json::from_str(row).unwrap();
        let record = s.rollout_routed_experts.as_ref().expect("a routing record");
        assert_eq!(record.num_tokens().unwrap(), s.tokens.len() - 1);
        assert_eq!(row["routed_experts"], serde_json::to_value(record).unwrap(), "{}", s.index);
        let lp: Vec<f32> = serde_json::from_value(row["log_probs"].clone()).unwrap();
        assert_eq!(lp, s.rollout_log_probs);
    }
    // A dense checkpoint has no experts to report.
    let dense = dir.join("dense");
    miles_tests::miles(&["init-model", "--out", dense.to_str().unwrap()]).unwrap();
    let err = miles_tests::miles(&[
        "score",
        "--hf-checkpoint",
        dense.to_str().unwrap(),
        "--input",
        out_s,
        "--routed-experts",
    ])
    .unwrap_err();
    assert!(format!("{err:#}").contains("has no experts to report"), "{err:#}");
}
