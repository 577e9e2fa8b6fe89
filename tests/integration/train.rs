//! `miles train` end to end: the demo learns from the reward (with a control that does not),
//! a killed and resumed run ends in the same bits as one that never stopped, a kill during a
//! save loses nothing, and bad inputs give clear errors without crashing a run.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use miles_cli::TrainArgs;
use miles_cli::train_cmd;
use miles_core::{Advantage, AdvantageOutput, SequenceScore};
use miles_tests::{miles, miles_binary, scratch};
use miles_train::rl::{self, Record};
use serde_json::Value;

/// The demo's configuration with `flags` on top, as `miles train` builds it.
fn demo_args(flags: &[(&str, Value)]) -> TrainArgs {
    let mut args = TrainArgs::default();
    for (k, v) in flags {
        args.flags.insert((*k).to_string(), v.clone());
    }
    args
}

fn eval_rewards(records: &[Record]) -> Vec<(u64, f64)> {
    records
        .iter()
        .filter_map(|r| Some((r.get("step")?.as_u64()?, r.get("eval/reward")?.as_f64()?)))
        .collect()
}

/// Zero advantages on every token: the control arm of the learning test.
struct ZeroAdvantage;

impl Advantage for ZeroAdvantage {
    fn compute(&self, groups: &[Vec<SequenceScore<'_>>]) -> miles_core::Result<AdvantageOutput> {
        let advantages = groups
            .iter()
            .map(|g| g.iter().map(|s| vec![0.0; s.loss_mask.len()]).collect())
            .collect();
        Ok(AdvantageOutput { advantages, returns: None })
    }
}

fn run_demo(name: &str, zero_advantages: bool) -> Vec<Record> {
    let dir = scratch(name);
    let args = demo_args(&[("run-dir", Value::from(dir.to_str().unwrap()))]);
    let cfg = train_cmd::run_config(&args).unwrap();
    let mut setup = train_cmd::setup(cfg).unwrap();
    if zero_advantages {
        setup.advantage = Box::new(ZeroAdvantage);
    }
    let mut records = Vec::new();
    rl::train(setup, &mut |r| records.push(r.clone())).unwrap();
    records
}

/// The acceptance test of RL: after the SFT warm-up the demo policy solves fewer than 40% of
/// the addition table (sampling at temperature 1); GRPO lifts it past 80% within the demo's
/// 200 iterations; the same run with every advantage zeroed does not, so the lift comes from
/// the reward signal and not from the warm-up or anything else in the loop.
#[test]
fn grpo_lifts_the_demo_past_0_8_and_zeroed_advantages_do_not() {
    let records = run_demo("train_learning", false);
    let evals = eval_rewards(&records);
    let (step0, start) = evals[0];
    assert_eq!(step0, 0);
    assert!(start < 0.4, "after the SFT warm-up the eval reward is {start}: {evals:?}");
    let best = evals.iter().map(|e| e.1).fold(0.0, f64::max);
    assert!(best >= 0.8, "GRPO reached only {best}: {evals:?}");
    let rl_steps = records.iter().filter(|r| r.get("rollout/raw_reward").is_some()).count();
    assert_eq!(rl_steps, 200);

    let control = eval_rewards(&run_demo("train_learning_control", true));
    assert_eq!(control[0].1, start, "both arms start from the same warm-up");
    let best = control.iter().map(|e| e.1).fold(0.0, f64::max);
    assert!(best < 0.8, "zeroed advantages reached {best}: {control:?}");
}

/// A tiny Qwen3-MoE policy (8 experts, 2 per token) learns the demo as the dense one does,
/// with and without Rollout Routing Replay: from under 0.4 after the warm-up past 0.8, its
/// rollout logprobs equal to the trainer's bit for bit on every iteration (the sparse layers
/// are batch-invariant too), the load-balancing loss and the routing mismatch logged (with
/// replay the experts used in training are always the rollout's).
#[test]
fn a_tiny_moe_learns_the_demo_past_0_8_with_and_without_replay() {
    let variants: &[bool] = if cfg!(feature = "r3") { &[false, true] } else { &[false] };
    for &replay in variants {
        let dir = scratch(&format!("train_moe_demo_{replay}"));
        let args = demo_args(&[
            ("run-dir", Value::from(dir.to_str().unwrap())),
            ("arch", Value::from("qwen3-moe")),
            ("use-rollout-routing-replay", Value::from(replay)),
        ]);
        let setup = train_cmd::setup(train_cmd::run_config(&args).unwrap()).unwrap();
        assert_eq!(setup.model.config.architecture, miles_model::Architecture::Qwen3Moe);
        let mut records = Vec::new();
        rl::train(setup, &mut |r| records.push(r.clone())).unwrap();
        let evals = eval_rewards(&records);
        let start = evals[0].1;
        assert!(start < 0.4, "replay {replay}: after the warm-up the eval is {start}: {evals:?}");
        let best = evals.iter().map(|e| e.1).fold(0.0, f64::max);
        assert!(best >= 0.8, "replay {replay}: GRPO reached only {best}: {evals:?}");
        let rl: Vec<&Record> =
            records.iter().filter(|r| r.get("rollout/raw_reward").is_some()).collect();
        assert_eq!(rl.len(), 200);
        let mut drift = 0.0;
        for r in rl {
            assert_eq!(r["train/train_rollout_logprob_abs_diff"], 0.0, "{r:?}");
            let aux = r["train/router_aux_loss"].as_f64().unwrap();
            assert!((1.0..8.0).contains(&aux), "{aux}");
            // Four optimizer steps per rollout: later steps' own choices drift from the record.
            drift += r["train/routed_experts_mismatch"].as_f64().unwrap();
            let used = r["train/replayed_experts_mismatch"].as_f64().unwrap();
            if replay {
                assert_eq!(used, 0.0, "{r:?}");
            } else {
                assert_eq!(used, r["train/routed_experts_mismatch"].as_f64().unwrap());
            }
        }
        assert!(drift > 0.0, "replay {replay}: the weights moved and no choice did");
    }
}

/// `--arch` picks the demo's architecture and is refused beside a checkpoint;
/// `--router-aux-loss-coef` needs a policy with experts.
#[test]
fn arch_and_router_flags_are_checked() {
    let run = |flags: &[(&str, Value)]| {
        train_cmd::run_config(&demo_args(flags)).and_then(|cfg| train_cmd::setup(cfg).map(drop))
    };
    let dir = scratch("train_arch_flags");
    let run_dir = ("run-dir", Value::from(dir.to_str().unwrap()));
    let err = run(&[run_dir.clone(), ("arch", Value::from("mixtral"))]).unwrap_err();
    assert!(format!("{err:#}").contains("qwen3-moe"), "{err:#}");
    let (ckpt, prompts) = checkpoint_and_prompts(&dir, "{\"input\": \"1+1=\"}\n");
    let err = run(&[
        ("arch", Value::from("llama")),
        ("hf-checkpoint", Value::from(ckpt)),
        ("prompt-data", Value::from(prompts)),
    ])
    .unwrap_err();
    assert!(
        format!("{err:#}").contains("--arch llama: the built-in demo's architecture"),
        "{err:#}"
    );
    let setup = train_cmd::setup(
        train_cmd::run_config(&demo_args(&[run_dir, ("router-aux-loss-coef", Value::from(0.1))]))
            .unwrap(),
    )
    .unwrap();
    let err = rl::train(setup, &mut |_| {}).unwrap_err();
    assert!(
        format!("{err:#}")
            .contains("--router-aux-loss-coef: the policy (Qwen3ForCausalLM) has no experts"),
        "{err:#}"
    );
}

/// Runs the real binary (faults come through the environment, so each run is its own
/// process).
fn run_binary(args: &[&str], fault: Option<&str>) -> Output {
    run_binary_with(args, fault, &[])
}

fn run_binary_with(args: &[&str], fault: Option<&str>, env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(miles_binary());
    cmd.arg("train").args(args).env("RAYON_NUM_THREADS", "2").envs(env.iter().copied());
    match fault {
        Some(f) => cmd.env("MILES_FAULT", f),
        None => cmd.env_remove("MILES_FAULT"),
    };
    cmd.output().expect("miles runs")
}

fn text(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

/// Flags of a short demo run: a short warm-up, small batches, two optimizer steps per rollout
/// (so AdamW moments and the data cursor both matter on resume), and a k3 KL loss to the
/// warmed-up reference (which each checkpoint must carry).
const SHORT: &str = "--sft-warmup-steps 40 --rollout-batch-size 8 --n-samples-per-prompt 4 \
                     --num-steps-per-rollout 2 --micro-batch-size 6 --eval-interval 100 \
                     --use-kl-loss --kl-loss-coef 0.05 --kl-loss-type k3 --save-interval 2";

fn short_run(dir: &Path, rollouts: usize) -> Vec<String> {
    run_args(SHORT, dir, rollouts)
}

fn run_args(flags: &str, dir: &Path, rollouts: usize) -> Vec<String> {
    let mut args: Vec<String> = flags.split_whitespace().map(String::from).collect();
    let d = dir.to_str().unwrap().to_string();
    args.extend(["--save".into(), d.clone(), "--load".into(), d]);
    args.extend(["--num-rollout".into(), rollouts.to_string()]);
    args
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

fn latest(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("latest_checkpointed_iteration.txt")).unwrap()
}

fn checkpoint_file(dir: &Path, iteration: u64, file: &str) -> Vec<u8> {
    std::fs::read(dir.join(format!("iter_{iteration:07}")).join(file)).unwrap()
}

/// Straight to 6 iterations, versus killed after iteration 5 (checkpoint at 4), resumed from
/// 4 and run to 6: the checkpoints of iteration 6 must be byte for byte the same.
fn check_exact_resume(name: &str, flags: &str, extra: &[&str]) {
    check_exact_resume_with(name, flags, extra, &[]);
}

/// Returns the straight run's directory.
fn check_exact_resume_with(
    name: &str,
    flags: &str,
    extra: &[&str],
    env: &[(&str, &str)],
) -> PathBuf {
    let root = scratch(name);
    let (straight, resumed) = (root.join("straight"), root.join("resumed"));
    let out = run_binary_with(&strs(&run_args(flags, &straight, 6)), None, env);
    assert!(out.status.success(), "{}", text(&out));

    let fault = Some("abort-after-rollout:5");
    let out = run_binary_with(&strs(&run_args(flags, &resumed, 6)), fault, env);
    assert!(!out.status.success(), "the fault must kill the run: {}", text(&out));
    assert_eq!(latest(&resumed), "4");
    let out = run_binary_with(&strs(&run_args(flags, &resumed, 6)), None, env);
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("resumed from iteration 4"), "{}", text(&out));

    let files = ["model.safetensors", "optimizer.safetensors", "trainer_state.json"];
    for file in files.iter().chain(extra) {
        assert!(
            checkpoint_file(&straight, 6, file) == checkpoint_file(&resumed, 6, file),
            "{file} differs between the straight and the resumed run"
        );
    }
    // The weights really moved: resuming did not just copy a checkpoint.
    assert_ne!(
        checkpoint_file(&straight, 4, "model.safetensors"),
        checkpoint_file(&straight, 6, "model.safetensors")
    );
    // The resumed run's metrics dropped the killed run's iteration 5 and appended 5 and 6:
    // one line per iteration, equal to the straight run's.
    let (a, b) = (iteration_records(&straight), iteration_records(&resumed));
    assert_eq!(b.len(), 6);
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x["step"], y["step"]);
        assert_eq!(x["rollout/raw_reward"], y["rollout/raw_reward"]);
        assert_eq!(x["train/loss"], y["train/loss"]);
    }
    straight
}

#[test]
fn a_killed_and_resumed_run_ends_bit_identical_to_an_uninterrupted_one() {
    check_exact_resume("train_exact_resume", SHORT, &["ref.safetensors"]);
}

/// Megatron's precision-aware optimizer with bf16 state: bf16 moments and (ours) bf16 master
/// weights rounded stochastically. The checkpoint keeps them (in F32, each a bf16 value; the
/// norms' masters stay f32), a kill and resume ends byte for byte as the straight run, and the
/// dtypes without the switch are refused naming the flag.
#[test]
fn bf16_optimizer_state_is_kept_and_resumes_exactly() {
    let flags = format!(
        "{SHORT} --use-precision-aware-optimizer --main-params-dtype bf16 --exp-avg-dtype bf16 \
         --exp-avg-sq-dtype bf16"
    );
    let dir = check_exact_resume_with("train_bf16_state", &flags, &[], &[]);
    let bf16_values = |file: &str, name_has: &str| {
        let bytes = checkpoint_file(&dir, 6, file);
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let (mut checked, mut nonzero) = (0, 0);
        for (name, t) in st.tensors() {
            if !name.contains(name_has) {
                continue;
            }
            assert_eq!(t.dtype(), safetensors::Dtype::F32, "{file} {name}");
            for word in t.data().chunks_exact(4) {
                let bits = u32::from_le_bytes(word.try_into().unwrap());
                assert_eq!(bits & 0xffff, 0, "{file} {name}: not a bf16 value");
                nonzero += usize::from(bits != 0);
            }
            checked += 1;
        }
        assert!(checked > 0 && nonzero > 1000, "{file}: {checked} tensors, {nonzero} nonzero");
    };
    bf16_values("optimizer.safetensors", "");
    bf16_values("model.safetensors", "_proj.weight");
    for flag in ["--exp-avg-dtype", "--main-params-dtype"] {
        let out = run_binary_with(&[flag, "bf16", "--num-rollout", "1"], None, &[]);
        let said = text(&out);
        assert!(
            !out.status.success() && said.contains("--use-precision-aware-optimizer"),
            "{said}"
        );
    }
}

/// Dynamic sampling with `--partial-rollout`: once the batch is full the engine aborts the
/// rest, whose groups the next iteration continues first; the run reports them (aborted
/// samples, the share of continued ones, their staleness), trains the trainer's own tokens
/// with logprobs equal to the rollout's bit for bit (the older policies' tokens differ, and
/// are reported apart), and a kill and resume ends byte for byte as the straight run, the
/// buffer of unfinished groups included.
#[test]
fn partial_rollouts_continue_aborted_groups_and_resume_exactly() {
    let flags = format!("{SHORT} --over-sampling-batch-size 12 --partial-rollout");
    let dir = check_exact_resume_with("train_partial_resume", &flags, &["ref.safetensors"], &[]);
    let records = iteration_records(&dir);
    let number = |r: &Value, key: &str| r[key].as_f64().unwrap_or_else(|| panic!("{key}: {r}"));
    assert!(records.iter().any(|r| number(r, "rollout/aborted") > 0.0), "nothing aborted");
    assert!(records.iter().any(|r| number(r, "rollout/partial_ratio") > 0.0), "none continued");
    assert!(records.iter().any(|r| number(r, "rollout/staleness/max") >= 1.0));
    let mut stale = 0;
    for r in &records {
        if let Some(own) = r.get("train/train_rollout_logprob_abs_diff/stale_0") {
            assert_eq!(own, 0.0, "{r}");
            stale += 1;
        }
    }
    assert!(stale > 0, "no iteration trained on older policies' tokens");
    let state: Value =
        serde_json::from_slice(&checkpoint_file(&dir, 6, "trainer_state.json")).unwrap();
    assert!(state["partial"].as_array().is_some_and(|p| !p.is_empty()), "{state}");
    // Resumed without --partial-rollout, the buffer is dropped with a warning that says so.
    let without = format!("{SHORT} --over-sampling-batch-size 12");
    let out = run_binary(&strs(&run_args(&without, &dir, 7)), None);
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("without --partial-rollout they are dropped"), "{}", text(&out));

    // Refused: partial rollouts without over-sampling, the mask without them.
    let d = scratch("train_partial_refused");
    let out = run_binary(&strs(&run_args("--partial-rollout", &d, 1)), None);
    assert!(!out.status.success() && text(&out).contains("--partial-rollout"), "{}", text(&out));
    assert!(text(&out).contains("--over-sampling-batch-size"), "{}", text(&out));
    let out = run_binary(&strs(&run_args("--mask-offpolicy-in-partial-rollout", &d, 1)), None);
    assert!(text(&out).contains("it needs --partial-rollout"), "{}", text(&out));
}

/// `--async`: each iteration's steps run beside the next iteration's rollout, which a copy of
/// the policy one version behind generates. After the first (synchronous) iteration every
/// trained sample is one version old, its gap to the trainer reported apart from the
/// trainer's own tokens; the rollout logprobs are that older version's own, bit for bit (the
/// checkpoint of the iteration before scores them); and a kill and resume ends byte for byte
/// as the straight run, the batch rolled out ahead included.
#[test]
fn one_step_off_async_trains_one_version_behind_and_resumes_exactly() {
    let flags = format!("{SHORT} --async");
    let dir = check_exact_resume_with("train_async_resume", &flags, &["ref.safetensors"], &[]);
    let records = iteration_records(&dir);
    for (i, r) in records.iter().enumerate() {
        let stale = r["rollout/staleness/mean"].as_f64().unwrap();
        assert_eq!(stale, if i == 0 { 0.0 } else { 1.0 }, "{r}");
        if i > 0 {
            assert!(r["train/train_rollout_logprob_abs_diff/stale_1"].as_f64().unwrap() > 0.0);
            assert!(r.get("train/train_rollout_logprob_abs_diff/stale_0").is_none(), "{r}");
            assert!(r["perf/rollout_wait_time"].is_number(), "{r}");
        }
    }

    // The batch checkpoint 2 holds, rolled out ahead by version 1, scored by checkpoint 1.
    let root = scratch("train_async_versions");
    let every = SHORT.replace("--save-interval 2", "--save-interval 1");
    let out = run_binary(&strs(&run_args(&format!("{every} --async"), &root, 3)), None);
    assert!(out.status.success(), "{}", text(&out));
    let state: Value =
        serde_json::from_slice(&checkpoint_file(&root, 2, "trainer_state.json")).unwrap();
    let samples = state["prefetched"]["samples"].as_array().unwrap();
    assert!(!samples.is_empty());
    let v1 = root.join("iter_0000001");
    let config = miles_model::ModelConfig::from_file(&v1.join("config.json")).unwrap();
    let weights = miles_model::Weights::load(&v1, &config).unwrap();
    let model = miles_model::Model::new(config, weights);
    let dm =
        miles_model::DeviceModel::new(&model, &miles_tensor::Device::Cpu, miles_tensor::DType::F32)
            .unwrap();
    let numbers = |v: &Value| -> Vec<f64> {
        v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
    };
    for s in samples {
        assert!(numbers(&s["versions"]).iter().all(|&v| v == 1.0), "{s}");
        let tokens: Vec<u32> = numbers(&s["tokens"]).iter().map(|&t| t as u32).collect();
        let prompt = s["prompt_len"].as_u64().unwrap() as usize;
        let batch = miles_model::PackedBatch::new(&[(tokens, prompt)]).unwrap();
        let (scored, _) = dm.logprobs(&batch, 1.0).unwrap();
        let rollout: Vec<f32> = numbers(&s["rollout_logp"]).iter().map(|&x| x as f32).collect();
        assert_eq!(scored, rollout, "a sample's rollout logprobs are not version 1's");
    }

    // Refused by flag: staleness 0 or 2, the GPU (no streams of its own yet).
    for (extra, want) in [
        ("--async --max-weight-staleness 0", "--max-weight-staleness: 0 with --async"),
        ("--async --max-weight-staleness 2", "exactly one step off"),
        ("--async --device cuda", "--async: runs on the CPU for now"),
    ] {
        let out = run_binary(&strs(&run_args(extra, &scratch("train_async_refused"), 1)), None);
        assert!(!out.status.success() && text(&out).contains(want), "{extra}: {}", text(&out));
    }
}

/// slime's named eval sets (`--eval-prompt-data NAME FILE …`): each is evaluated apart, its
/// figures under its name; `--eval-top-p` samples them.
#[test]
fn named_eval_sets_report_apart() {
    let dir = scratch("train_named_eval");
    let line = |a: u32, b: u32| format!("{{\"input\": \"{a}+{b}=\", \"label\": \"{}\"}}\n", a + b);
    let (easy, hard) = (dir.join("easy.jsonl"), dir.join("hard.jsonl"));
    std::fs::write(&easy, (0..3).map(|a| line(a, 0)).collect::<String>()).unwrap();
    std::fs::write(&hard, (5..9).map(|a| line(a, 9)).collect::<String>()).unwrap();
    let args = format!(
        "--sft-warmup-steps 5 --rollout-batch-size 4 --n-samples-per-prompt 2 --num-rollout 2 \
         --eval-interval 2 --n-samples-per-eval-prompt 2 --eval-top-p 0.9 --run-dir {} \
         --eval-prompt-data easy {} hard {}",
        dir.display(),
        easy.display(),
        hard.display()
    );
    let out = run_binary(&args.split_whitespace().collect::<Vec<_>>(), None);
    assert!(out.status.success(), "{}", text(&out));
    let records: Vec<Value> = std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let last = records.last().unwrap();
    for key in
        ["eval/easy", "eval/easy/pass@1", "eval/easy/pass@2", "eval/hard", "eval/hard/pass@2"]
    {
        assert!(last[key].is_number(), "{key}: {last}");
    }
    assert!(last.get("eval/reward").is_none(), "{last}");
}

/// A checkpoint with a flipped bit stops the resumed run with the file named; with
/// `--load-fallback` the run resumes from the newest intact checkpoint before it and says so.
#[test]
fn a_damaged_checkpoint_is_named_and_the_fallback_resumes_before_it() {
    let dir = scratch("train_damaged_checkpoint");
    let out = run_binary(&strs(&run_args(SHORT, &dir, 4)), None);
    assert!(out.status.success(), "{}", text(&out));
    let model = dir.join("iter_0000004").join("model.safetensors");
    let mut bytes = std::fs::read(&model).unwrap();
    let at = bytes.len() - 3;
    bytes[at] ^= 1;
    std::fs::write(&model, bytes).unwrap();
    let out = run_binary(&strs(&run_args(SHORT, &dir, 6)), None);
    assert!(!out.status.success(), "{}", text(&out));
    let said = text(&out);
    assert!(
        said.contains("iter_0000004/model.safetensors") && said.contains("--load-fallback"),
        "{said}"
    );
    let out = run_binary(&strs(&run_args(&format!("{SHORT} --load-fallback"), &dir, 6)), None);
    let said = text(&out);
    assert!(out.status.success(), "{said}");
    assert!(
        said.contains("skipping iteration 4") && said.contains("resumed from iteration 2"),
        "{said}"
    );
}

/// A Qwen3-MoE run with Rollout Routing Replay resumes to the same bytes (per-expert
/// weights, their AdamW moments), and the experts used in training are the rollout's.
#[cfg(feature = "r3")]
#[test]
fn a_moe_run_with_replay_resumes_exactly() {
    let flags = format!("{SHORT} --arch qwen3-moe --use-rollout-routing-replay");
    let dir = check_exact_resume_with("train_moe_resume", &flags, &["ref.safetensors"], &[]);
    for r in &iteration_records(&dir) {
        assert_eq!(r["train/replayed_experts_mismatch"], 0.0, "{r}");
        assert!(r["train/routed_experts_mismatch"].is_number(), "{r}");
        assert!(r["train/router_aux_loss"].is_number(), "{r}");
    }
}

/// A speculative run whose draft trains online (from scratch) resumes to the same bytes, the
/// draft and its moments included; its rollout logprobs are the trainer's bit for bit, and it
/// reports the draft's loss and acceptance, which rise as the draft learns.
#[cfg(feature = "eagle-spec")]
#[test]
fn a_speculative_run_with_mtp_training_resumes_exactly() {
    let flags = format!(
        "{SHORT} --sglang-speculative-algorithm EAGLE --sglang-speculative-num-steps 2 \
         --enable-mtp-training --mtp-loss-scaling-factor 0.2 --mtp-lr 2e-3"
    );
    let draft = [
        "ref.safetensors",
        "draft/model.safetensors",
        "draft/exp_avg/model.safetensors",
        "draft/exp_avg_sq/model.safetensors",
        "draft/optimizer.json",
    ];
    let dir = check_exact_resume_with("train_spec_resume", &flags, &draft, &[]);
    let records = iteration_records(&dir);
    for r in &records {
        assert_eq!(r["train/train_rollout_logprob_abs_diff"], 0.0, "{r}");
        assert!(r["train/mtp_loss"].as_f64().unwrap() > 0.0, "{r}");
        let rate = r["rollout/spec_accept_rate"].as_f64().unwrap();
        let length = r["rollout/spec_accept_length"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&rate) && (1.0..=3.0).contains(&length), "{r}");
    }
    // The draft learns from scratch during the warm-up's supervised steps.
    let sft: Vec<f64> = std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).unwrap()["sft/mtp_loss"].as_f64())
        .collect();
    assert_eq!(sft.len(), 40);
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let (early, late) = (mean(&sft[..5]), mean(&sft[35..]));
    assert!(late < 0.5 * early, "the draft learns: MTP loss {early} then {late}");
}

/// A fresh draft warmed up on the first rollout's samples (`--mtp-warmup-steps`): its loss on
/// them falls well below the step's own MTP loss, only the first iteration warms up, and the
/// second rollout keeps more drafts than a draft that learned online only.
#[cfg(feature = "eagle-spec")]
#[test]
fn a_fresh_draft_warms_up_on_the_first_rollout() {
    let run = |name: &str, warmup: usize| -> Vec<Value> {
        let dir = scratch(name);
        let flags = format!(
            "--sft-warmup-steps 0 --rollout-batch-size 8 --n-samples-per-prompt 4 \
             --micro-batch-size 6 --eval-interval 100 --sglang-speculative-algorithm EAGLE \
             --sglang-speculative-num-steps 2 --enable-mtp-training --mtp-lr 2e-3 \
             --mtp-warmup-steps {warmup}"
        );
        let mut args = run_args(&flags, &dir, 2);
        args.extend(["--run-dir".into(), dir.to_str().unwrap().into()]);
        miles(&strs(&["train".to_string()].iter().chain(&args).cloned().collect::<Vec<_>>()))
            .unwrap();
        iteration_records(&dir)
    };
    let (warm, cold) = (run("train_mtp_warmup", 60), run("train_mtp_cold", 0));
    let first = &warm[0];
    let (step, warmed) =
        (first["train/mtp_loss"].as_f64().unwrap(), first["train/mtp_warmup_loss"].as_f64());
    assert!(warmed.is_some_and(|w| w < 0.8 * step), "MTP loss {step}, after warm-up {warmed:?}");
    assert!(
        warm[1].get("train/mtp_warmup_loss").is_none()
            && cold[0].get("train/mtp_warmup_loss").is_none()
    );
    let rate = |r: &Value| r["rollout/spec_accept_rate"].as_f64().unwrap();
    assert!(
        rate(&warm[1]) > rate(&cold[1]),
        "accept rates {} and {}",
        rate(&warm[1]),
        rate(&cold[1])
    );
}

/// The records of a run's iterations.
fn iteration_records(dir: &Path) -> Vec<Value> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .filter(|r: &Value| r.get("rollout/raw_reward").is_some())
        .collect()
}

/// `--nproc-per-node 2`: each process rolls out its part of every optimizer step's prompt
/// groups and the gradients are summed over them, so the run is the one-process run: the same
/// samples (rewards and counts exactly), the same losses up to the order of the sums; rank 0
/// writes the metrics (rank 0's weights broadcast at the start). `env` adds to the runs'
/// environment.
fn two_processes_train_as_one(name: &str, env: &[(&str, &str)]) {
    processes_train_as_one(name, 2, "", env, &[]);
}

/// [`two_processes_train_as_one`] over `procs` processes, with `flags` added to both runs, and
/// `metrics` compared too.
fn processes_train_as_one(
    name: &str,
    procs: usize,
    flags: &str,
    env: &[(&str, &str)],
    metrics: &[&str],
) -> Vec<Value> {
    let flags = format!(
        "--sft-warmup-steps 20 --rollout-batch-size 8 --n-samples-per-prompt 4 \
         --eval-interval 100 {flags}"
    );
    let root = scratch(name);
    let run = |sub: &str, extra: &str| {
        let dir = root.join(sub);
        let args = format!("{flags} {extra} --run-dir {} --num-rollout 4", dir.display());
        let argv: Vec<String> = args.split_whitespace().map(String::from).collect();
        let out = run_binary_with(&strs(&argv), None, env);
        assert!(out.status.success(), "{sub}: {}", text(&out));
        (iteration_records(&dir), text(&out))
    };
    let (one, _) = run("one", "");
    let (two, report) = run("two", &format!("--nproc-per-node {procs}"));
    assert!(
        report.contains(&format!("{procs} worker processes"))
            && report.contains("trained 4 iterations"),
        "{report}"
    );
    assert_eq!(one.len(), 4);
    assert_eq!(two.len(), 4, "rank 0 alone writes the metrics");
    for (a, b) in one.iter().zip(&two) {
        for key in
            ["rollout/raw_reward", "rollout/samples", "rollout/generated_tokens", "train/steps"]
        {
            assert_eq!(a[key], b[key], "{key}: {a} vs {b}");
        }
        // (The device model's host tensors are a reference, not batch-invariant: there the
        // gap is rounding, as in one process.)
        let gap = b["train/train_rollout_logprob_abs_diff"].as_f64().unwrap();
        let bucketed = env.iter().any(|(k, _)| *k == "MILES_GRAD_BUCKET_BYTES");
        assert!(if bucketed { gap < 1e-6 } else { gap == 0.0 }, "logprob gap {gap}");
        // The last iteration's eval, each rank over its part of the prompts.
        for key in ["eval/reward", "eval/pass@1", "eval/pass@4"] {
            assert_eq!(a.get(key).is_some(), b.get(key).is_some(), "{key}");
            if let (Some(x), Some(y)) = (a.get(key), b.get(key)) {
                let (x, y) = (x.as_f64().unwrap(), y.as_f64().unwrap());
                assert!((x - y).abs() <= 1e-12, "{key}: {x} vs {y}");
            }
        }
        for &key in ["train/loss", "train/grad_norm", "train/pg_clipfrac"].iter().chain(metrics) {
            let (x, y) = (a[key].as_f64().unwrap(), b[key].as_f64().unwrap());
            assert!((x - y).abs() <= 1e-6 * (1.0 + x.abs()), "{key}: {x} vs {y}");
        }
    }
    two
}

/// Speculative rollouts with a draft trained online run over two processes as in one: the
/// draft starts as rank 0's, its gradients and MTP loss are summed over the ranks, and the
/// samples, acceptance and losses are the one process's.
#[cfg(feature = "eagle-spec")]
#[test]
fn two_processes_speculate_and_train_the_draft_as_one() {
    let flags = "--sglang-speculative-algorithm EAGLE --enable-mtp-training";
    let metrics = ["train/mtp_loss", "rollout/spec_accept_rate", "rollout/spec_accept_length"];
    processes_train_as_one("train_two_processes_spec", 2, flags, &[], &metrics);
}

/// What needs the whole batch works over two processes as in one: advantages whitened over
/// every rank's samples (REINFORCE++'s own whitening, then `--normalize-advantages`), TIS's
/// batch normalization by the whole batch's mean weight, and the TIS/MIS metrics averaged over
/// the ranks.
#[test]
fn two_processes_whiten_and_correct_over_the_whole_batch() {
    processes_train_as_one(
        "train_two_processes_whiten",
        2,
        "--advantage-estimator reinforce_plus_plus_baseline --normalize-advantages --use-tis \
         --tis-batch-normalize --num-steps-per-rollout 2",
        &[],
        &[
            "train/mis_is_ratio_mean_final",
            "train/mis_training_log_ppl",
            "train/mis_batch_norm_factor",
        ],
    );
}

/// Samples dropped on one rank (a reward that fails three samples of the third group, rank 1's)
/// move every step's boundaries over two processes as they move one process's: the first step
/// takes a sample of rank 0's second-step groups too, and the steps train on the same samples.
#[test]
fn two_processes_cut_steps_as_one_when_samples_drop() {
    if Command::new("python3").arg("--version").output().is_err() {
        println!("skipping: no python3");
        return;
    }
    let dir = scratch("train_two_processes_dropped_reward");
    let file = dir.join("flaky.py");
    std::fs::write(
        &file,
        "def score(sample):\n    if sample[\"index\"] in (8, 9, 10):\n        raise ValueError(\"unscorable\")\n    \
         return 1.0 if sample[\"label\"] in sample[\"response\"] else 0.0\n",
    )
    .unwrap();
    let two = processes_train_as_one(
        "train_two_processes_dropped",
        2,
        &format!("--custom-rm-path {}:score --num-steps-per-rollout 2", file.display()),
        &[],
        &["rollout/failed"],
    );
    // Rank 0 logs the first failure whichever rank saw it.
    for r in &two {
        let e = r["rollout/first_error"].as_str().unwrap_or_default();
        assert!(e.starts_with("rank 1: ") && e.contains("unscorable"), "{r}");
    }
}

/// A mixture of experts with Rollout Routing Replay over two processes: the routing figures
/// are summed over the ranks like the loss. (Without the load-balancing loss: it is a product
/// of two means over a micro-batch's tokens, so it depends on how the batch is cut, as it does
/// per rank and micro-batch in Megatron.)
#[test]
fn two_processes_train_a_mixture_of_experts_as_one() {
    processes_train_as_one(
        "train_two_processes_moe",
        2,
        "--arch qwen3-moe --use-rollout-routing-replay --router-aux-loss-coef 0",
        &[],
        &["train/replayed_experts_mismatch", "train/routed_experts_mismatch"],
    );
}

/// Ranks left without samples keep in step with the others: one group a batch over four
/// processes under dynamic sampling, so three ranks hold nothing, with whitening, TIS (its
/// metrics reach rank 0 from whichever rank has them) and steps no rank has samples for.
/// (Dynamic sampling over several processes generates whole rounds; the one-process run is
/// told to as well, where it would abort once its batch is full.)
#[test]
fn ranks_without_samples_keep_in_step() {
    let rounds = [("MILES_DYNAMIC_SAMPLING_ROUNDS", "1")];
    processes_train_as_one(
        "train_ranks_without_samples",
        4,
        "--rollout-batch-size 1 --over-sampling-batch-size 8 --num-steps-per-rollout 2 \
         --advantage-estimator reinforce_plus_plus_baseline --normalize-advantages --use-tis \
         --tis-batch-normalize",
        &rounds,
        &["train/mis_is_ratio_mean_final", "train/mis_batch_norm_factor"],
    );
    // No group kept at all (every group solved or failed alike): no rank takes a step, as one
    // process takes none.
    let root = scratch("train_no_group_kept");
    let steps = |procs: usize| {
        let dir = root.join(procs.to_string());
        let args = format!(
            "--sft-warmup-steps 20 --rollout-batch-size 1 --over-sampling-batch-size 4 \
             --n-samples-per-prompt 4 --num-rollout 3 --eval-interval 100 --use-tis \
             --tis-batch-normalize --nproc-per-node {procs} --run-dir {}",
            dir.display()
        );
        let argv: Vec<String> = args.split_whitespace().map(String::from).collect();
        let out = run_binary_with(&strs(&argv), None, &rounds);
        assert!(out.status.success(), "{procs}: {}", text(&out));
        let records = iteration_records(&dir);
        // The counts, and which train/ figures there are (none of TIS's without samples).
        let figures = |r: &Value| -> Vec<Value> {
            let keys = r.as_object().unwrap().keys().filter(|k| k.starts_with("train/mis_"));
            keys.map(|k| Value::from(k.as_str())).collect()
        };
        records
            .iter()
            .map(|r| {
                [vec![r["rollout/samples"].clone(), r["train/steps"].clone()], figures(r)].concat()
            })
            .collect()
    };
    let one: Vec<Vec<Value>> = steps(1);
    assert!(one.iter().any(|r| r[0] == 0), "{one:?}: a batch with no group");
    assert_eq!(steps(4), one);
}

/// A single Slurm task (`srun -n1 miles train --nproc-per-node 2`) is one process: it starts
/// its workers as a plain run does, instead of training alone.
#[test]
fn a_single_slurm_task_starts_its_workers() {
    let dir = scratch("train_single_slurm_task");
    let args = format!(
        "--sft-warmup-steps 5 --rollout-batch-size 4 --n-samples-per-prompt 2 --num-rollout 1 \
         --num-steps-per-rollout 1 --eval-interval 100 --nproc-per-node 2 --run-dir {}",
        dir.display()
    );
    let argv: Vec<String> = args.split_whitespace().map(String::from).collect();
    let slurm = [("SLURM_PROCID", "0"), ("SLURM_NTASKS", "1"), ("SLURM_LOCALID", "0")];
    let out = run_binary_with(&strs(&argv), None, &slurm);
    let report = text(&out);
    assert!(out.status.success(), "{report}");
    assert!(report.contains("2 worker processes"), "{report}");
}

/// Supervised iterations (`--loss-type sft_loss`) over two processes: each rank takes its part
/// of every step's rows, and the steps are one process's.
#[test]
fn two_processes_run_supervised_steps_as_one() {
    let root = scratch("train_two_processes_sft");
    let losses = |sub: &str, extra: &str| {
        let dir = root.join(sub);
        let args = format!(
            "--loss-type sft_loss --sft-warmup-steps 0 --lr 3e-3 --num-rollout 3 \
             --rollout-batch-size 8 --num-steps-per-rollout 2 --eval-interval 100 {extra} \
             --run-dir {}",
            dir.display()
        );
        let argv: Vec<String> = args.split_whitespace().map(String::from).collect();
        let out = run_binary(&strs(&argv), None);
        assert!(out.status.success(), "{sub}: {}", text(&out));
        std::fs::read_to_string(dir.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .filter_map(|r| Some([r.get("train/loss")?.as_f64()?, r["train/grad_norm"].as_f64()?]))
            .collect::<Vec<_>>()
    };
    let (one, two) = (losses("one", ""), losses("two", "--nproc-per-node 2"));
    assert_eq!(one.len(), 3);
    assert_eq!(two.len(), 3);
    for (a, b) in one.iter().flatten().zip(two.iter().flatten()) {
        assert!((a - b).abs() <= 1e-6 * (1.0 + a.abs()), "{a} vs {b}");
    }
}

/// Dynamic sampling over two processes keeps the groups one process generating whole rounds
/// keeps: each rank rolls out half of every draw, the groups with a reward spread are taken in
/// drawn order over both, and each optimizer step takes the samples it would take in one
/// process.
#[test]
fn two_processes_sample_dynamically_as_one() {
    processes_train_as_one(
        "train_two_processes_dynamic",
        2,
        "--over-sampling-batch-size 12 --num-steps-per-rollout 2",
        &[("MILES_DYNAMIC_SAMPLING_ROUNDS", "1")],
        &["rollout/zero_std/count", "rollout/response_len/mean"],
    );
}

/// Two processes train as one (above); a run killed and resumed over two processes ends with
/// the bytes of an uninterrupted one.
#[test]
fn two_processes_train_as_one_and_resume_exactly() {
    two_processes_train_as_one("train_two_processes", &[]);
    check_exact_resume(
        "train_two_processes_resume",
        &format!("{SHORT} --nproc-per-node 2"),
        &["ref.safetensors"],
    );
}

/// `--load` with another number of processes (any that divides the batch): a run saved by one
/// process and resumed by two goes on as the one-process run (the same samples, the losses up
/// to the order of the sums), and one saved by two resumes on one.
#[test]
fn a_checkpoint_resumes_with_another_number_of_processes() {
    let root = scratch("train_resume_other_world");
    let straight = root.join("straight");
    let out = run_binary(&strs(&run_args(SHORT, &straight, 6)), None);
    assert!(out.status.success(), "{}", text(&out));
    let two = format!("{SHORT} --nproc-per-node 2");
    for (name, first, then) in
        [("one-then-two", SHORT, two.as_str()), ("two-then-one", &two, SHORT)]
    {
        let resumed = root.join(name);
        let out = run_binary(&strs(&run_args(first, &resumed, 6)), Some("abort-after-rollout:5"));
        assert!(!out.status.success(), "{name}: the fault must kill the run: {}", text(&out));
        assert_eq!(latest(&resumed), "4", "{name}");
        let out = run_binary(&strs(&run_args(then, &resumed, 6)), None);
        assert!(out.status.success(), "{name}: {}", text(&out));
        assert!(text(&out).contains("resumed from iteration 4"), "{name}: {}", text(&out));
        let (a, b) = (iteration_records(&straight), iteration_records(&resumed));
        assert_eq!(b.len(), 6, "{name}");
        for (x, y) in a.iter().zip(&b) {
            for key in ["step", "rollout/raw_reward", "rollout/samples", "train/steps"] {
                assert_eq!(x[key], y[key], "{name} {key}: {x} vs {y}");
            }
            for key in ["train/loss", "train/grad_norm"] {
                let (p, q) = (x[key].as_f64().unwrap(), y[key].as_f64().unwrap());
                assert!((p - q).abs() <= 1e-6 * (1.0 + p.abs()), "{name} {key}: {p} vs {q}");
            }
        }
    }
}

/// Two processes train as one with their gradient sums in buckets of 4 KiB started during the
/// backward as its layers finish (over TCP: CI's stand-in for NCCL, which sums the same
/// gradients on GPUs).
#[test]
fn two_processes_with_small_gradient_buckets_train_as_one() {
    two_processes_train_as_one(
        "train_two_bucketed_processes",
        &[("MILES_GRAD_BUCKET_BYTES", "4096")],
    );
}

/// A worker that dies stops the run: the launcher names it and stops the other, which would
/// otherwise wait for it; and what several processes do not support yet is refused by flag.
#[test]
fn a_dead_worker_stops_the_run_and_unsupported_flags_are_named() {
    let dir = scratch("train_dead_worker");
    let args = format!("{SHORT} --nproc-per-node 2 --num-rollout 6 --run-dir {}", dir.display());
    let argv: Vec<String> = args.split_whitespace().map(String::from).collect();
    let started = std::time::Instant::now();
    let out =
        run_binary_with(&strs(&argv), Some("abort-after-rollout:2"), &[("MILES_FAULT_RANK", "1")]);
    assert!(!out.status.success());
    // Rank 1 aborted; rank 0 saw its connection close and stopped too.
    let report = text(&out);
    assert!(
        report.contains("worker 1 (signal: 6") || report.contains(", worker 1 (signal"),
        "{report}"
    );
    assert!(report.contains("rank 1 closed its connection"), "{report}");
    assert!(started.elapsed() < std::time::Duration::from_secs(120));
    let run_dir = dir.join("indivisible");
    let indivisible = ["--nproc-per-node", "3", "--rollout-batch-size", "8", "--num-rollout", "1"];
    let out =
        run_binary(&[&indivisible[..], &["--run-dir", run_dir.to_str().unwrap()]].concat(), None);
    assert!(text(&out).contains("multiple of"), "{}", text(&out));
    let uneven = ["--over-sampling-batch-size", "9"].map(String::from);
    let out = run_binary(&strs(&[argv.clone(), uneven.to_vec()].concat()), None);
    let report = text(&out);
    assert!(report.contains("--over-sampling-batch-size: 9 prompt groups a draw"), "{report}");
}

/// With one optimizer step per rollout the old logprobs are the step's own forward's: the run
/// ends with the same bytes and metrics as one that computes them in a forward of their own,
/// over several micro-batches, and when a step is skipped (NaN loss at step 2, whose logprob
/// gap then comes from a separate forward).
#[test]
fn old_logprobs_from_the_training_step_give_the_bits_of_a_separate_forward() {
    let flags = "--sft-warmup-steps 20 --rollout-batch-size 4 --n-samples-per-prompt 4 \
                 --num-steps-per-rollout 1 --micro-batch-size 5 --eval-interval 100 \
                 --use-kl-loss --kl-loss-coef 0.05 --entropy-coef 0.01 --lr 1e-3";
    let root = scratch("train_old_logprobs_in_step");
    let name = "cpu";
    let run = |sub: &str, separate: bool| -> (Vec<u8>, Vec<u8>, Vec<Value>) {
        let dir = root.join(name).join(sub);
        let mut env: Vec<(&str, &str)> = Vec::new();
        if separate {
            env.push(("MILES_SEPARATE_OLD_LOGPROBS", "1"));
        }
        let out =
            run_binary_with(&strs(&run_args(flags, &dir, 3)), Some("nan-loss-at-step:2"), &env);
        assert!(out.status.success(), "{name} {sub}: {}", text(&out));
        let metrics = iteration_records(&dir);
        let file = |f| checkpoint_file(&dir, 3, f);
        (file("model.safetensors"), file("optimizer.safetensors"), metrics)
    };
    let (model, optimizer, in_step) = run("in-step", false);
    let (model_s, optimizer_s, separate) = run("separate", true);
    assert!(model == model_s, "{name}: the weights differ");
    assert!(optimizer == optimizer_s, "{name}: the AdamW state differs");
    assert_eq!(in_step.len(), 3);
    for (i, (a, b)) in in_step.iter().zip(&separate).enumerate() {
        for key in ["train/loss", "train/ppo_kl", "train/pg_clipfrac", "train/kl_loss"] {
            assert_eq!(a.get(key), b.get(key), "{name} {key}: {a} vs {b}");
        }
        let gap = "train/train_rollout_logprob_abs_diff";
        assert_eq!(a[gap], b[gap], "{name}: {a} vs {b}");
        assert_eq!(a[gap], 0.0, "{name}: {a}");
        // One step per rollout; the second iteration's was the NaN one.
        assert_eq!(a["train/steps"], u64::from(i != 1), "{name}: {a}");
    }
    assert_eq!(in_step[1]["train/skipped_steps"], 1, "{name}: {}", in_step[1]);
    assert_eq!(in_step[2]["train/skipped_steps"], 1, "{name}: {}", in_step[2]);
}

/// Without a warm-up the KL reference is the initial model, rebuilt on resume, not the
/// resumed policy (an entropy bonus moves the policy although the reward is all zeros).
#[test]
fn a_resumed_run_keeps_the_initial_model_as_kl_reference() {
    let flags = "--sft-warmup-steps 0 --rollout-batch-size 4 --n-samples-per-prompt 2 \
                 --eval-interval 100 --use-kl-loss --kl-loss-coef 0.5 --kl-loss-type k3 \
                 --entropy-coef 0.05 --lr 1e-2 --save-interval 2";
    check_exact_resume("train_exact_resume_kl", flags, &[]);
}

#[test]
fn a_kill_during_save_leaves_the_previous_checkpoint_and_the_run_resumes() {
    let dir = scratch("train_kill_during_save");
    let out = run_binary(&strs(&short_run(&dir, 2)), None);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(latest(&dir), "2");
    let out = run_binary(&strs(&short_run(&dir, 4)), Some("abort-during-save"));
    assert!(!out.status.success(), "the fault must kill the run: {}", text(&out));
    assert_eq!(latest(&dir), "2", "the pointer moved before the checkpoint was complete");
    assert!(!dir.join("iter_0000004").exists());
    let out = run_binary(&strs(&short_run(&dir, 4)), None);
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("resumed from iteration 2"), "{}", text(&out));
    assert_eq!(latest(&dir), "4");
    assert!(!dir.join(".iter_0000004.tmp").exists(), "the stale temp dir was cleaned");
}

/// A disk that fills up during a save (injected ENOSPC half-way through the optimizer file):
/// the run stops naming the file and the bytes, the temporary files are gone, the previous
/// checkpoint stays the latest, and resuming from it ends bit for bit where an uninterrupted
/// run does. With --continue-on-save-error the run trains on past the failed save.
#[test]
fn a_full_disk_during_a_save_keeps_the_previous_checkpoint_and_the_run_resumes_exactly() {
    let root = scratch("train_enospc");
    let (straight, full) = (root.join("straight"), root.join("full"));
    let out = run_binary(&strs(&short_run(&straight, 4)), None);
    assert!(out.status.success(), "{}", text(&out));

    let out = run_binary(&strs(&short_run(&full, 4)), Some("enospc-during-save:4"));
    assert!(!out.status.success(), "a failed save must stop the run: {}", text(&out));
    let said = text(&out);
    for what in [
        ".iter_0000004.tmp/optimizer.safetensors: no space left on the device",
        "bytes (",
        "iter_0000002 stays the latest checkpoint",
        "--continue-on-save-error",
    ] {
        assert!(said.contains(what), "{what}: {said}");
    }
    assert_eq!(latest(&full), "2");
    assert!(!full.join(".iter_0000004.tmp").exists() && !full.join("iter_0000004").exists());
    let out = run_binary(&strs(&short_run(&full, 4)), None);
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("resumed from iteration 2"), "{}", text(&out));
    for file in ["model.safetensors", "optimizer.safetensors", "trainer_state.json"] {
        assert!(
            checkpoint_file(&straight, 4, file) == checkpoint_file(&full, 4, file),
            "{file} differs between the straight and the resumed run"
        );
    }

    let on = root.join("continue");
    let mut args = short_run(&on, 4);
    args.push("--continue-on-save-error".into());
    let out = run_binary(&strs(&args), Some("enospc-during-save:2"));
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("warning: --save"), "{}", text(&out));
    assert_eq!(latest(&on), "4");
    assert!(!on.join("iter_0000002").exists() && !on.join(".iter_0000002.tmp").exists());
    assert!(
        checkpoint_file(&straight, 4, "model.safetensors")
            == checkpoint_file(&on, 4, "model.safetensors")
    );
}

/// `--async-save`: a thread writes the checkpoints while training goes on; they are byte for
/// byte the synchronous ones, and a save that fails is reported when the loop next waits for
/// it (here at the end), stopping the run with the previous checkpoint the latest.
#[test]
fn async_saves_write_the_same_checkpoints_and_report_a_full_disk() {
    let root = scratch("train_async_save");
    let (sync, threaded, full) = (root.join("sync"), root.join("async"), root.join("full"));
    let out = run_binary(&strs(&short_run(&sync, 4)), None);
    assert!(out.status.success(), "{}", text(&out));
    let mut args = short_run(&threaded, 4);
    args.push("--async-save".into());
    let out = run_binary(&strs(&args), None);
    assert!(out.status.success(), "{}", text(&out));
    for iteration in [2, 4] {
        for file in
            ["model.safetensors", "optimizer.safetensors", "ref.safetensors", "checksums.json"]
        {
            assert!(
                checkpoint_file(&sync, iteration, file)
                    == checkpoint_file(&threaded, iteration, file),
                "iteration {iteration}: {file} differs with --async-save"
            );
        }
    }
    let mut args = short_run(&full, 4);
    args.push("--async-save".into());
    let out = run_binary(&strs(&args), Some("enospc-during-save:4"));
    assert!(!out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("iteration 4: "), "{}", text(&out));
    assert!(text(&out).contains("no space left on the device"), "{}", text(&out));
    assert_eq!(latest(&full), "2");
}

#[test]
fn a_nan_loss_skips_the_step_counts_it_and_the_run_goes_on() {
    let dir = scratch("train_nan_loss");
    let d = dir.to_str().unwrap();
    let args = [
        "--sft-warmup-steps",
        "2",
        "--rollout-batch-size",
        "4",
        "--n-samples-per-prompt",
        "4",
        "--num-steps-per-rollout",
        "2",
        "--num-rollout",
        "3",
        "--run-dir",
        d,
    ];
    let out = run_binary(&args, Some("nan-loss-at-step:3"));
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("(1 steps skipped)"), "{}", text(&out));
    let records: Vec<Value> = std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .filter(|r: &Value| r.get("train/skipped_steps").is_some())
        .collect();
    let skipped: Vec<u64> =
        records.iter().map(|r| r["train/skipped_steps"].as_u64().unwrap()).collect();
    let applied: Vec<u64> = records.iter().map(|r| r["train/steps"].as_u64().unwrap()).collect();
    // Step 3 is the first of iteration 2: it is skipped, its sibling still applies.
    assert_eq!(skipped, [0, 1, 1]);
    assert_eq!(applied, [2, 1, 2]);
    assert!(records.iter().all(|r| r["train/loss"].as_f64().is_some_and(f64::is_finite)));
}

/// `miles train` in-process with whitespace-separated `flags` and then `more` (paths, JSON).
fn train(flags: &str, more: &[&str]) -> Result<String, String> {
    let mut args = vec!["train"];
    args.extend(flags.split_whitespace());
    args.extend(more);
    miles(&args)
}

/// A tiny model checkpoint and a prompt file for runs that are not the demo.
fn checkpoint_and_prompts(dir: &Path, prompts: &str) -> (String, String) {
    let ckpt = dir.join("ckpt");
    miles(&["init-model", "--preset", "tiny", "--out", ckpt.to_str().unwrap()]).unwrap();
    let data = dir.join("prompts.jsonl");
    std::fs::write(&data, prompts).unwrap();
    (ckpt.to_str().unwrap().to_string(), data.to_str().unwrap().to_string())
}

/// Speculative flags without their partners, a draft of another model and a plugin setting
/// out of range are refused naming the flag, the file and the tensor.
#[cfg(feature = "eagle-spec")]
#[test]
fn bad_speculative_settings_and_drafts_are_named() {
    use miles_model::draft::{Draft, DraftFormat};
    let dir = scratch("train_bad_drafts");
    let (ckpt, data) = checkpoint_and_prompts(&dir, "{\"input\": \"1+1=\", \"label\": \"2\"}\n");
    let base = format!(
        "--hf-checkpoint {ckpt} --prompt-data {data} --label-key label --rm-type exact_match \
         --num-rollout 1 --rollout-max-response-len 4 --run-dir {}",
        dir.join("runs").display()
    );
    let e = train(&base, &["--sglang-speculative-algorithm", "EAGLE"]).unwrap_err();
    assert!(e.contains("--sglang-speculative-algorithm") && e.contains("needs a draft"), "{e}");
    let e = train(&base, &["--sglang-speculative-num-steps", "2"]).unwrap_err();
    assert!(e.contains("--sglang-speculative-num-steps") && e.contains("only with"), "{e}");
    let e = train(&base, &["--mtp-lr", "1e-3"]).unwrap_err();
    assert!(e.contains("--mtp-lr") && e.contains("--enable-mtp-training"), "{e}");
    let e = train(&base, &["--mtp-warmup-steps", "5"]).unwrap_err();
    assert!(e.contains("--mtp-warmup-steps") && e.contains("--enable-mtp-training"), "{e}");
    let spec = ["--sglang-speculative-algorithm", "EAGLE", "--enable-mtp-training"];
    let e = train(&base, &[&spec[..], &["--sglang-speculative-eagle-topk", "2"]].concat());
    assert!(e.as_ref().unwrap_err().contains("sglang-speculative-eagle-topk"), "{e:?}");
    // A draft of a wider model.
    let mut wide = miles_model::presets::preset("tiny", None).unwrap();
    wide.hidden_size *= 2;
    let draft_dir = dir.join("wide_draft");
    Draft::random(&wide, DraftFormat::DeepSeek, 1).unwrap().save(&draft_dir, &wide).unwrap();
    let path = draft_dir.to_str().unwrap();
    let e = train(&base, &[&spec[..2], &["--sglang-speculative-draft-model-path", path]].concat())
        .unwrap_err();
    assert!(e.contains("--sglang-speculative-draft-model-path") && e.contains("eh_proj"), "{e}");
    assert!(e.contains("hidden size"), "{e}");
    // And a run that speculates with the checkpoint's own draft, written by a first run.
    let save = dir.join("run");
    let out = train(&base, &[&spec[..], &["--save", save.to_str().unwrap()]].concat()).unwrap();
    let draft = save.join("iter_0000001/draft");
    let path = draft.to_str().unwrap();
    let more = [&spec[..2], &["--sglang-speculative-draft-model-path", path]].concat();
    assert!(train(&base, &more).is_ok(), "{out}");
}

/// A DeepSeek-V3 checkpoint's own MTP layer (`miles init-model --arch deepseek-v3` writes one
/// at model.layers.2): a run that speculates without a draft path starts from it and
/// `--save-hf` writes it back unchanged; with `--enable-mtp-training` it is trained and written
/// trained; a run with neither keeps it as it came. Rollout logprobs stay the trainer's.
#[cfg(feature = "eagle-spec")]
#[test]
fn a_deepseek_checkpoints_mtp_layer_is_its_draft_and_is_kept() {
    use miles_model::draft::Draft;
    let dir = scratch("train_deepseek_mtp");
    let ckpt = dir.join("ckpt");
    let made = miles(&["init-model", "--arch", "deepseek-v3", "--out", ckpt.to_str().unwrap()]);
    assert!(made.unwrap().contains("and an MTP layer"));
    let data = dir.join("prompts.jsonl");
    std::fs::write(&data, "{\"input\": \"1+1=\", \"label\": \"2\"}\n").unwrap();
    let config = miles_model::ModelConfig::from_file(&ckpt.join("config.json")).unwrap();
    let own = Draft::load(&ckpt, &config).unwrap();
    let base = format!(
        "--hf-checkpoint {} --prompt-data {} --label-key label --rm-type exact_match \
         --num-rollout 2 --rollout-batch-size 1 --n-samples-per-prompt 4 \
         --rollout-max-response-len 6",
        ckpt.display(),
        data.display()
    );
    let run = |name: &str, flags: &[&str]| -> (Draft, Vec<Value>) {
        let (hf, run_dir) = (dir.join(format!("{name}_hf")), dir.join(name));
        let paths = ["--save-hf", hf.to_str().unwrap(), "--run-dir", run_dir.to_str().unwrap()];
        let report = train(&base, &[flags, &paths[..]].concat()).unwrap();
        assert!(report.contains("trained 2 iterations"), "{name}: {report}");
        let saved = miles_model::ModelConfig::from_file(&hf.join("config.json")).unwrap();
        assert_eq!(saved.mla.as_ref().unwrap().mtp_layers, 1, "{name}");
        let records = iteration_records(&run_dir);
        for r in &records {
            assert_eq!(r["train/train_rollout_logprob_abs_diff"], 0.0, "{name}: {r}");
        }
        (Draft::load(&hf, &saved).unwrap(), records)
    };
    let speculate =
        ["--sglang-speculative-algorithm", "EAGLE", "--sglang-speculative-num-steps", "2"];
    let (frozen, records) = run("speculate", &speculate);
    assert!(frozen == own, "the checkpoint's MTP layer, not trained, comes back as it was");
    assert!(records.iter().any(|r| r["rollout/spec_accept_rate"].as_f64().is_some()));
    let trained = [&speculate[..], &["--enable-mtp-training"]].concat();
    let (trained, records) = run("mtp", &trained);
    assert!(trained != own, "MTP training changed nothing");
    assert!(records.iter().all(|r| r["train/mtp_loss"].as_f64().is_some_and(f64::is_finite)));
    let (kept, _) = run("plain", &[]);
    assert!(kept == own, "a run without a draft keeps the checkpoint's MTP layer");
}

#[test]
fn bad_prompt_files_name_the_file_and_line() {
    let dir = scratch("train_bad_prompts");
    let (ckpt, data) = checkpoint_and_prompts(
        &dir,
        "{\"input\": \"1+1=\", \"label\": \"2\"}\n{\"input\": \"2+2=\", \"label\": 4\n",
    );
    let run = |data: &str| {
        miles(&[
            "train",
            "--hf-checkpoint",
            &ckpt,
            "--prompt-data",
            data,
            "--label-key",
            "label",
            "--rm-type",
            "exact_match",
            "--num-rollout",
            "1",
        ])
        .unwrap_err()
    };
    let err = run(&data);
    assert!(err.contains("--prompt-data") && err.contains("prompts.jsonl:2"), "{err}");

    let missing = dir.join("missing_key.jsonl");
    std::fs::write(&missing, "{\"input\": \"1+1=\", \"label\": \"2\"}\n{\"question\": \"2+2=\"}\n")
        .unwrap();
    let err = run(missing.to_str().unwrap());
    assert!(err.contains("missing_key.jsonl:2") && err.contains("input"), "{err}");
}

#[test]
fn unknown_estimator_and_missing_reward_are_flag_errors() {
    let err = miles(&["train", "--advantage-estimator", "ppo2"]).unwrap_err();
    assert!(err.contains("--advantage-estimator") && err.contains("grpo, gspo"), "{err}");
    let err = miles(&["train", "--advantage-estimator", "ppo"]).unwrap_err();
    assert!(err.contains("needs a critic"), "{err}");
    let dir = scratch("train_no_reward");
    let (ckpt, data) = checkpoint_and_prompts(&dir, "{\"input\": \"1+1=\"}\n");
    let err =
        miles(&["train", "--hf-checkpoint", &ckpt, "--prompt-data", &data, "--num-rollout", "1"])
            .unwrap_err();
    assert!(err.contains("--rm-type"), "{err}");
    let err = miles(&["train", "--eval-interval", "0"]).unwrap_err();
    assert!(err.contains("--eval-interval"), "{err}");
    let err = miles(&["train", "--config", dir.join("nope.toml").to_str().unwrap()]).unwrap_err();
    assert!(err.contains("nope.toml"), "{err}");
}

/// A reward server that is down fails every sample: the run counts them and finishes, and its
/// final eval says that every eval sample failed rather than print a reward of 0.
#[test]
fn an_unreachable_reward_server_fails_samples_not_the_run() {
    let dir = scratch("train_rm_down");
    let (ckpt, data) = checkpoint_and_prompts(
        &dir,
        "{\"input\": \"1+1=\", \"label\": \"2\"}\n{\"input\": \"2+2=\", \"label\": \"4\"}\n",
    );
    // Port 9 (discard) on the loopback: nothing listens, so connections are refused.
    let run = dir.join("run");
    let flags = "--label-key label --rm-url http://127.0.0.1:9/score --rollout-batch-size 2 \
                 --n-samples-per-prompt 2 --rollout-max-response-len 4 --num-rollout 1";
    let settings = r#"{"max_retries": 1, "backoff_ms": 1}"#;
    let paths =
        ["--hf-checkpoint", &ckpt, "--prompt-data", &data, "--run-dir", run.to_str().unwrap()];
    let eval = ["--eval-prompt-data", &data, "--eval-interval", "1"];
    let report =
        train(flags, &[&paths[..], &eval, &["--custom-rm-config", settings]].concat()).unwrap();
    assert!(report.contains("trained 1 iterations"), "{report}");
    assert!(
        report.contains("final eval reward none: every one of the 2 eval samples failed"),
        "{report}"
    );
    let line = std::fs::read_to_string(dir.join("run").join("metrics.jsonl")).unwrap();
    let record: Value = serde_json::from_str(line.lines().last().unwrap()).unwrap();
    assert_eq!(record["rollout/failed"], 4, "{record}");
    assert_eq!(record["rollout/samples"], 0, "{record}");
    assert!(report.contains("4 samples failed, first:"), "{report}");
}

/// `--loss-type sft_loss` trains on the labels (slime's SFT), with no rollout and no reward.
#[test]
fn an_sft_run_trains_on_the_labels() {
    let dir = scratch("train_sft_run");
    let report = miles(&[
        "train",
        "--loss-type",
        "sft_loss",
        "--sft-warmup-steps",
        "0",
        "--lr",
        "3e-3",
        "--num-rollout",
        "30",
        "--eval-interval",
        "30",
        "--run-dir",
        dir.to_str().unwrap(),
    ])
    .unwrap();
    assert!(report.contains("trained 30 iterations"), "{report}");
    let records: Vec<Value> = std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let losses: Vec<f64> = records.iter().filter_map(|r| r["train/loss"].as_f64()).collect();
    assert_eq!(losses.len(), 30);
    assert!(losses[29] < 0.5 * losses[0], "SFT loss {} -> {}", losses[0], losses[29]);
    assert!(records.iter().all(|r| r.get("rollout/raw_reward").is_none()));
    let evals =
        eval_rewards(&records.iter().map(|r| r.as_object().unwrap().clone()).collect::<Vec<_>>());
    assert!(evals.last().unwrap().1 > evals[0].1, "{evals:?}");
}

/// `--device`: a bad name says what is valid; a build or machine without CUDA says so.
#[test]
fn device_runs_are_checked() {
    let dir = scratch("train_device_flags");
    let run = |flags: &[&str]| {
        let mut args = vec!["train", "--num-rollout", "1", "--run-dir", dir.to_str().unwrap()];
        args.extend_from_slice(flags);
        miles(&args).unwrap_err()
    };
    let err = run(&["--device", "gpu"]);
    assert!(err.contains("--device") && err.contains("cuda:N"), "{err}");
    if miles_tensor::Device::Cuda(0).ensure_available().is_err() {
        let err = run(&["--device", "cuda"]);
        assert!(err.contains("--device cuda") && err.contains("CUDA"), "{err}");
        let err = run(&["--device", "cuda", "--loss-type", "sft_loss", "--sft-warmup-steps", "0"]);
        assert!(err.contains("--device cuda") && err.contains("CUDA"), "{err}");
    }
}

/// The example configurations parse into valid run settings (their paths are checked by runs).
#[test]
fn example_configs_are_valid() {
    let root = miles_tests::workspace_root().join("examples");
    let mut seen = 0;
    // The examples' configs and those of their directories.
    let mut paths = Vec::new();
    for entry in std::fs::read_dir(&root).unwrap() {
        let path = entry.unwrap().path();
        match path.is_dir() {
            true => paths.extend(std::fs::read_dir(&path).unwrap().map(|e| e.unwrap().path())),
            false => paths.push(path),
        }
    }
    for path in paths {
        // (A plugin's Cargo.toml is not a run's configuration.)
        if path.extension().is_some_and(|e| e == "toml") && !path.ends_with("Cargo.toml") {
            let args = TrainArgs { config: Some(path.clone()), ..TrainArgs::default() };
            let cfg = train_cmd::run_config(&args).unwrap_or_else(|e| panic!("{e:#}"));
            assert!(cfg.hf_checkpoint.is_some() && cfg.prompt_data.is_some(), "{path:?}");
            seen += 1;
        }
    }
    assert!(seen >= 1);
}

/// Flags on the demo are checked against the demo's settings, not the bare defaults.
#[test]
fn demo_flags_combine_with_the_demo_settings() {
    let cfg = |flags: &[(&str, Value)]| train_cmd::run_config(&demo_args(flags));
    assert_eq!(cfg(&[("min-lr", Value::from(1e-5))]).unwrap().min_lr, 1e-5);
    let by_epoch = cfg(&[("num-epoch", Value::from(3))]).unwrap();
    assert_eq!((by_epoch.num_rollout, by_epoch.num_epoch), (None, Some(3)));
    assert_eq!(
        cfg(&[("global-batch-size", Value::from(128))]).unwrap().global_batch_size,
        Some(128)
    );
}

/// Every estimator and the loss and sampling options run end to end on the demo, with finite
/// losses; `--use-tis` sees weights of exactly 1 because trainer and rollout logprobs agree bit
/// for bit; `--save-hf` writes a model that `miles score` loads.
#[test]
fn every_estimator_and_option_runs_end_to_end() {
    let base = "--sft-warmup-steps 20 --rollout-batch-size 4 --n-samples-per-prompt 4 \
                --num-rollout 2 --eval-interval 100 --num-steps-per-rollout 2";
    let variants = [
        "--advantage-estimator gspo",
        "--advantage-estimator rloo --calculate-per-token-loss",
        "--advantage-estimator reinforce_plus_plus --kl-coef 0.1 --gamma 0.9 --use-kl-loss",
        "--advantage-estimator reinforce_plus_plus_baseline --kl-coef 0.1 --use-kl-loss",
        "--normalize-advantages --eps-clip-high 0.28 --eps-clip-c 3 --entropy-coef 0.01",
        "--over-sampling-batch-size 8 --use-kl-loss --kl-loss-type low_var_kl --micro-batch-size 3",
        "--use-tis --tis-mode mask --tis-clip-low 0.5 --lr-warmup-iters 1 --lr-decay-style cosine",
        "--use-tis --tis-mode icepop --use-rs --rs-level sequence --rs-veto-threshold 1e-4 \
         --tis-batch-normalize",
        "--use-rollout-logprobs --global-batch-size 8 --weight-decay 0.1",
        "--advantage-estimator cispo --eps-clip 1 --eps-clip-high 4 --use-opsm --opsm-delta 0.01 \
         --use-kl-loss --use-unbiased-kl --kl-loss-type k3",
        "--disable-rewards-normalization --disable-grpo-std-normalization",
    ];
    for (i, variant) in variants.iter().enumerate() {
        let dir = scratch(&format!("train_variant_{i}"));
        let hf = dir.join("hf");
        let paths = ["--run-dir", dir.to_str().unwrap(), "--save-hf", hf.to_str().unwrap()];
        let report = train(&format!("{base} {variant}"), &paths)
            .unwrap_or_else(|e| panic!("{variant}: {e}"));
        assert!(report.contains("trained 2 iterations (0 steps skipped)"), "{variant}: {report}");
        let records = iteration_records(&dir);
        assert_eq!(records.len(), 2, "{variant}");
        for r in &records {
            assert_eq!(r["train/train_rollout_logprob_abs_diff"], 0.0, "{variant}: {r}");
            if r["train/steps"].as_u64() != Some(0) {
                assert!(r["train/loss"].as_f64().is_some_and(f64::is_finite), "{variant}: {r}");
            }
            if variant.contains("--use-tis") {
                assert_eq!(r["train/mis_is_ratio_mean_final"], 1.0, "{variant}: {r}");
                assert_eq!(r["train/tis_clipfrac"], 0.0, "{variant}: {r}");
                assert_eq!(r["train/mis_kl"], 0.0, "{variant}: {r}");
            }
            if variant.contains("--use-opsm") && r["train/steps"].as_u64() != Some(0) {
                assert!(r["train/opsm_clipfrac"].as_f64().is_some(), "{variant}: {r}");
            }
        }
        let pairs = dir.join("pairs.jsonl");
        std::fs::write(&pairs, "{\"prompt\": \"2+3=\", \"response\": \"5\"}\n").unwrap();
        let hf = hf.to_str().unwrap();
        miles(&["score", "--hf-checkpoint", hf, "--input", pairs.to_str().unwrap()]).unwrap();
    }
}

/// `--use-tensorboard`: TensorBoard's own reader (the package `cargo xtask ci` installs, on
/// `MILES_TENSORBOARD_PYTHONPATH`) finds every number of `metrics.jsonl` at its step.
#[test]
fn tensorboard_reads_every_metric_back() {
    let dir = scratch("train_tensorboard");
    let d = dir.to_str().unwrap();
    let flags = "--sft-warmup-steps 3 --rollout-batch-size 4 --n-samples-per-prompt 2 \
                 --eval-interval 1 --num-rollout 2 --use-tensorboard";
    let mut args: Vec<&str> = vec!["train", "--run-dir", d];
    args.extend(flags.split_whitespace());
    miles(&args).unwrap();
    let records: Vec<Value> = std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let events = dir.join(rl::TENSORBOARD_DIR);
    assert!(std::fs::read_dir(&events).unwrap().count() == 1, "one event file");
    let Some(pkg) = std::env::var_os("MILES_TENSORBOARD_PYTHONPATH") else {
        println!("skipping TensorBoard's reader: MILES_TENSORBOARD_PYTHONPATH is unset");
        return;
    };
    let script = miles_tests::workspace_root().join("tests/fixtures/tensorboard/read_events.py");
    let out = Command::new("python3").arg(script).arg(&events).env("PYTHONPATH", pkg).output();
    let out = out.expect("python3 runs");
    assert!(out.status.success(), "{}", text(&out));
    let series: serde_json::Map<String, Value> = serde_json::from_slice(&out.stdout).unwrap();
    let mut checked = 0;
    for record in &records {
        let step = record["step"].as_i64().unwrap();
        for (tag, v) in record.as_object().unwrap() {
            let (Some(v), false) = (v.as_f64(), tag == "step") else { continue };
            let points = series.get(tag).and_then(Value::as_array);
            let at = points.and_then(|p| p.iter().find(|p| p[0].as_i64() == Some(step)));
            // TensorBoard keeps f32s; compared as f32 (a printed f64 may parse an ulp away).
            let got = at.and_then(|p| p[1].as_f64()).map(|g| g as f32);
            assert_eq!(got, Some(v as f32), "{tag} at step {step}");
            checked += 1;
        }
    }
    let points: usize = series.values().map(|s| s.as_array().unwrap().len()).sum();
    assert_eq!(points, checked, "TensorBoard holds exactly the metrics' numbers");
    assert!(checked > 50, "only {checked} numbers");
}

/// A Python reward whose worker dies on every call is restarted `max_restarts` times, then the
/// run stops with an error naming the file, instead of training on failed samples.
#[test]
fn a_python_reward_that_keeps_crashing_stops_the_run() {
    if Command::new("python3").arg("--version").output().is_err() {
        println!("skipping: no python3");
        return;
    }
    let dir = scratch("train_python_reward_crash");
    let file = dir.join("crash.py");
    std::fs::write(&file, "import os\n\ndef score(sample):\n    os._exit(3)\n").unwrap();
    let spec = format!("{}:score", file.display());
    let run = dir.join("run");
    let err = miles(&[
        "train",
        "--num-rollout",
        "1",
        "--sft-warmup-steps",
        "0",
        "--custom-rm-path",
        &spec,
        "--custom-rm-config",
        r#"{"max_restarts": 1, "backoff_ms": 1}"#,
        "--run-dir",
        run.to_str().unwrap(),
    ])
    .unwrap_err();
    assert!(err.contains("the reward stopped working") && err.contains("crash.py"), "{err}");
}

/// `miles plot A B --out DIR` draws both runs in each chart; several runs need `--out`.
#[test]
fn plot_draws_runs_side_by_side() {
    let root = scratch("plot_side_by_side");
    let mut dirs = Vec::new();
    for (name, reward) in [("one", 0.25), ("two", 0.5)] {
        let dir = root.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        let lines: Vec<String> = (1..=5)
            .map(|s| {
                format!(r#"{{"step": {s}, "rollout/raw_reward": {}}}"#, reward + 0.1 * s as f64)
            })
            .collect();
        std::fs::write(dir.join("metrics.jsonl"), lines.join("\n")).unwrap();
        dirs.push(dir.to_str().unwrap().to_string());
    }
    let out = root.join("compare");
    let report = miles(&["plot", &dirs[0], &dirs[1], "--out", out.to_str().unwrap()]).unwrap();
    assert!(report.contains("plotted 1 of") && report.contains("from 10 records"), "{report}");
    assert!(out.join("reward.png").is_file());
    let err = miles(&["plot", &dirs[0], &dirs[1]]).unwrap_err();
    assert!(err.contains("--out: say where"), "{err}");
    let one = miles(&["plot", &dirs[0]]).unwrap();
    assert!(root.join("one/plots/reward.png").is_file(), "{one}");
}

/// Unified FP8 on the CPU (`--fp8-format e4m3 --fp8-recipe blockwise`): the demo's rollouts and
/// training forward read the same E4M3 weights, requantized after every step, so the rollout
/// and training logprobs are equal bit for bit on every iteration, and the policy still learns
/// the addition table (the mixture-of-experts policy: its attention and experts in FP8, with
/// Rollout Routing Replay where r3 is built; the dense policy's FP8 rollouts are checked in
/// miles-rollout); its `--save-hf` is FP8.
#[cfg(feature = "fp8")]
#[test]
fn fp8_demo_runs_learn_with_rollout_logprobs_equal_to_trainings() {
    for (arch, bf16_first) in [("qwen3-moe", 0)] {
        let dir = scratch(&format!("train_fp8_demo_{arch}"));
        let args = demo_args(&[
            ("run-dir", Value::from(dir.to_str().unwrap())),
            ("arch", Value::from(arch)),
            ("fp8-format", Value::from("e4m3")),
            ("fp8-recipe", Value::from("blockwise")),
            ("num-layers-at-start-in-bf16", Value::from(bf16_first)),
            ("save-hf", Value::from(dir.join("hf").to_str().unwrap())),
            // With the r3 plugin, the training forward replays the rollout's routing too.
            ("use-rollout-routing-replay", Value::from(cfg!(feature = "r3"))),
        ]);
        let setup = train_cmd::setup(train_cmd::run_config(&args).unwrap()).unwrap();
        let mut records = Vec::new();
        let summary = rl::train(setup, &mut |r| records.push(r.clone())).unwrap();
        check_fp8_export(&dir.join("hf"), &summary.weights);
        let rl: Vec<&Record> =
            records.iter().filter(|r| r.get("rollout/raw_reward").is_some()).collect();
        assert_eq!(rl.len(), 200);
        for r in rl {
            assert_eq!(r["train/train_rollout_logprob_abs_diff"], 0.0, "{arch}: {r:?}");
        }
        let evals = eval_rewards(&records);
        // Every layer of this tiny policy in E4M3 (3 mantissa bits, hidden size 64) learns
        // less far than bf16's 0.8: measured 0.18 → 0.76 at iteration 100 (0.8 and more with
        // its first layer kept in bf16). The bar here is that it clearly learns.
        let (start, best) = (evals[0].1, evals.iter().map(|e| e.1).fold(0.0, f64::max));
        assert!(start < 0.4 && best >= 0.6, "{arch} in FP8: {start} → {best}: {evals:?}");
    }
}

/// INT4 QAT on the CPU (`--int4-qat --int4-group-size 32`, miles' recipe): rollout and
/// training logprobs are equal bit for bit on every iteration, and the demo policy, every
/// linear of it fake-quantized to 15 levels, still learns the addition table; its `--save-hf`
/// is compressed-tensors INT4 that loads back to the weights the forward read. Its flags
/// without their partner, a group that does not divide a row and FP8 beside it are refused by
/// name.
#[cfg(feature = "int4-qat")]
#[test]
fn int4_qat_demo_runs_learn_with_rollout_logprobs_equal_to_trainings() {
    let dir = scratch("train_int4_demo");
    let args = demo_args(&[
        ("run-dir", Value::from(dir.to_str().unwrap())),
        ("int4-qat", Value::from(true)),
        ("int4-group-size", Value::from(32)),
        ("save-hf", Value::from(dir.join("hf").to_str().unwrap())),
    ]);
    let setup = train_cmd::setup(train_cmd::run_config(&args).unwrap()).unwrap();
    let mut records = Vec::new();
    let summary = rl::train(setup, &mut |r| records.push(r.clone())).unwrap();
    // The export is compressed-tensors INT4 and loads back to the very weights the forward
    // read: the masters fake-quantized.
    let hf = dir.join("hf");
    let config = miles_model::ModelConfig::from_file(&hf.join("config.json")).unwrap();
    let loaded = miles_model::Weights::load(&hf, &config).unwrap();
    let spec = miles_model::weights::tensor_spec(&config);
    let pairs = loaded.tensors().into_iter().zip(summary.weights.tensors());
    for ((name, shape), (got, master)) in spec.iter().zip(pairs) {
        let want = if name.starts_with("model.layers.") && name.ends_with("_proj.weight") {
            miles_tensor::cpu::fake_quantize_int4(master, shape[1], 32).unwrap()
        } else {
            master.clone()
        };
        assert_eq!(*got, want, "{name}");
    }
    let rl: Vec<&Record> =
        records.iter().filter(|r| r.get("rollout/raw_reward").is_some()).collect();
    assert_eq!(rl.len(), 200);
    for r in rl {
        assert_eq!(r["train/train_rollout_logprob_abs_diff"], 0.0, "{r:?}");
    }
    let evals = eval_rewards(&records);
    let (start, best) = (evals[0].1, evals.iter().map(|e| e.1).fold(0.0, f64::max));
    assert!(start < 0.4 && best >= 0.6, "INT4 QAT: {start} → {best}: {evals:?}");

    let refused = |more: &[(&str, Value)]| {
        let mut pairs = vec![("run-dir", Value::from(dir.to_str().unwrap()))];
        pairs.extend(more.iter().cloned());
        let run = train_cmd::run_config(&demo_args(&pairs)).and_then(train_cmd::setup);
        match run.and_then(|s| rl::train(s, &mut |_| {})) {
            Ok(_) => panic!("{more:?} ran"),
            Err(e) => format!("{e:#}"),
        }
    };
    let on = ("int4-qat", Value::from(true));
    let e = refused(&[("int4-group-size", Value::from(32))]);
    assert!(e.contains("--int4-group-size") && e.contains("with --int4-qat"), "{e}");
    let e = refused(&[on.clone(), ("int4-group-size", Value::from(64))]);
    assert!(e.contains("--int4-group-size") && e.contains("128 or 32"), "{e}");
    let e = refused(std::slice::from_ref(&on));
    assert!(e.contains("--int4-group-size 128: does not divide"), "{e}");
    let e = refused(&[on, ("fp8-format", Value::from("e4m3"))]);
    assert!(e.contains("--int4-qat") && e.contains("one quantization"), "{e}");
}

/// INT4 QAT of a mixture of experts' routed experts only (`--int4-experts-only`, miles'
/// choice) with Rollout Routing Replay: the rollout and training logprobs stay equal bit for
/// bit, the training forward replays the rollout's experts, and the policy learns.
#[cfg(all(feature = "int4-qat", feature = "r3"))]
#[test]
fn int4_qat_trains_a_mixture_of_experts_with_routing_replay() {
    let dir = scratch("train_int4_moe");
    let args = demo_args(&[
        ("run-dir", Value::from(dir.to_str().unwrap())),
        ("arch", Value::from("qwen3-moe")),
        ("int4-qat", Value::from(true)),
        ("int4-group-size", Value::from(32)),
        ("int4-experts-only", Value::from(true)),
        ("use-rollout-routing-replay", Value::from(true)),
    ]);
    let setup = train_cmd::setup(train_cmd::run_config(&args).unwrap()).unwrap();
    let mut records = Vec::new();
    rl::train(setup, &mut |r| records.push(r.clone())).unwrap();
    let rl: Vec<&Record> =
        records.iter().filter(|r| r.get("rollout/raw_reward").is_some()).collect();
    assert_eq!(rl.len(), 200);
    for r in rl {
        assert_eq!(r["train/train_rollout_logprob_abs_diff"], 0.0, "{r:?}");
        assert_eq!(r["train/replayed_experts_mismatch"], 0.0, "{r:?}");
    }
    let evals = eval_rewards(&records);
    let (start, best) = (evals[0].1, evals.iter().map(|e| e.1).fold(0.0, f64::max));
    assert!(start < 0.4 && best >= 0.6, "INT4 QAT of the experts: {start} → {best}: {evals:?}");
}

/// Rollout-only FP8, miles' default for an FP8 checkpoint: `miles convert fp8` writes
/// DeepSeek-V3's format, and training from it without `--fp8-format` runs the engine on its
/// E4M3 weights and the training forward in f32: the mismatch shows on every iteration, and
/// with `--use-tis` the policy still learns.
#[cfg(feature = "fp8")]
#[test]
fn fp8_checkpoints_train_rollout_only_with_the_mismatch_reported() {
    let dir = scratch("train_fp8_rollout_only");
    // The conversion, of the mixture-of-experts fixture (its router among the modules kept).
    let src = miles_tests::workspace_root().join("tests/fixtures/hf/qwen3_moe");
    let converted = dir.join("moe-fp8");
    let report =
        miles(&["convert", "fp8", src.to_str().unwrap(), "--out", converted.to_str().unwrap()]);
    assert!(report.as_ref().is_ok_and(|r| r.contains("matrices in E4M3")), "{report:?}");
    let c = miles_model::ModelConfig::from_file(&src.join("config.json")).unwrap();
    check_fp8_export(&converted, &miles_model::Weights::load(&src, &c).unwrap());
    // A converted checkpoint trains as rollout-only FP8.
    let (ckpt, prompts) = checkpoint_and_prompts(&dir, "{\"input\": \"1+1=\", \"label\": \"2\"}\n");
    let fp8_ckpt = dir.join("tiny-fp8");
    miles(&["convert", "fp8", &ckpt, "--out", fp8_ckpt.to_str().unwrap()]).unwrap();
    let flags = |ckpt: &Path| {
        demo_args(&[
            ("hf-checkpoint", Value::from(ckpt.to_str().unwrap())),
            ("prompt-data", Value::from(prompts.as_str())),
            ("label-key", Value::from("label")),
            ("rm-type", Value::from("exact_match")),
        ])
    };
    let setup = |ckpt: &Path| train_cmd::setup(train_cmd::run_config(&flags(ckpt)).unwrap());
    assert!(setup(&fp8_ckpt).unwrap().fp8_checkpoint);
    assert!(!setup(Path::new(&ckpt)).unwrap().fp8_checkpoint);

    // The demo, its policy as if from an FP8 checkpoint, with TIS.
    let args = demo_args(&[
        ("run-dir", Value::from(dir.join("run").to_str().unwrap())),
        ("use-tis", Value::from(true)),
        ("num-rollout", Value::from(100)),
    ]);
    let mut setup = train_cmd::setup(train_cmd::run_config(&args).unwrap()).unwrap();
    setup.fp8_checkpoint = true;
    let mut records = Vec::new();
    rl::train(setup, &mut |r| records.push(r.clone())).unwrap();
    let rl: Vec<&Record> =
        records.iter().filter(|r| r.get("rollout/raw_reward").is_some()).collect();
    assert_eq!(rl.len(), 100);
    for r in rl {
        let gap = r["train/train_rollout_logprob_abs_diff"].as_f64().unwrap();
        assert!(gap > 0.0 && gap < 0.2, "rollout-only FP8 without a mismatch: {r:?}");
        assert!(r.get("train/tis_abs").is_some_and(|v| v.as_f64().unwrap() > 0.0), "{r:?}");
    }
    // Measured 0.17 → 0.64 at iteration 100, still climbing (the tiny policy's E4M3 rollouts
    // differ from its f32 training by 0.009 to 0.036 in mean |Δlogp| per token).
    let evals = eval_rewards(&records);
    let (start, best) = (evals[0].1, evals.iter().map(|e| e.1).fold(0.0, f64::max));
    assert!(start < 0.4 && best >= 0.55, "rollout-only FP8: {start} → {best}: {evals:?}");
}

/// `--save-hf` of an FP8 run: DeepSeek-V3's format (projections and experts in F8_E4M3 with
/// f32 `weight_scale_inv` blocks, config.json's `quantization_config` naming the linear
/// modules left in high precision), which loads back as the codes' values: the final weights
/// quantized by the codec, the rest unchanged.
#[cfg(feature = "fp8")]
fn check_fp8_export(dir: &Path, finals: &miles_model::Weights) {
    use miles_tensor::cpu::{dequantize_blocks, quantize_blocks};
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let q = &config["quantization_config"];
    assert_eq!((&q["quant_method"], &q["fmt"]), (&Value::from("fp8"), &Value::from("e4m3")));
    assert_eq!(q["weight_block_size"], serde_json::json!([128, 128]));
    let kept: Vec<&str> = q["modules_to_not_convert"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert!(kept.contains(&"lm_head") && kept.contains(&"model.layers.0.mlp.gate"), "{kept:?}");
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let down = st.tensor("model.layers.1.self_attn.o_proj.weight").unwrap();
    assert_eq!(down.dtype(), safetensors::Dtype::F8_E4M3);
    let scales = st.tensor("model.layers.1.self_attn.o_proj.weight_scale_inv").unwrap();
    assert_eq!(scales.dtype(), safetensors::Dtype::F32);

    let c = miles_model::ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let loaded = miles_model::Weights::load(dir, &c).unwrap();
    let spec = miles_model::weights::tensor_spec(&c);
    let mut fp8 = 0;
    for ((name, shape), (got, want)) in
        spec.iter().zip(loaded.tensors().into_iter().zip(finals.tensors()))
    {
        if name.starts_with("model.layers.") && name.ends_with("_proj.weight") {
            let (codes, scales) = quantize_blocks(want, shape[0], shape[1]);
            assert_eq!(*got, dequantize_blocks(&codes, &scales, shape[0], shape[1]), "{name}");
            fp8 += 1;
        } else {
            assert_eq!(got, want, "{name}");
        }
    }
    assert!(fp8 > 0);
}

/// The FP8 flags are checked: a recipe or bf16 layers without a format, an unknown format or
/// recipe, more bf16 layers than the model has, and Transformer Engine's power-of-two scales.
#[cfg(feature = "fp8")]
#[test]
fn fp8_flags_are_checked() {
    let run = |flags: &[(&str, Value)]| {
        train_cmd::run_config(&demo_args(flags)).and_then(|cfg| train_cmd::setup(cfg).map(drop))
    };
    let err = |flags: &[(&str, Value)]| format!("{:#}", run(flags).unwrap_err());
    let e = err(&[("fp8-recipe", Value::from("blockwise"))]);
    assert!(e.contains("--fp8-recipe") && e.contains("needs --fp8-format e4m3"), "{e}");
    let e = err(&[("num-layers-at-end-in-bf16", Value::from(2))]);
    assert!(e.contains("--num-layers-at-end-in-bf16"), "{e}");
    let e = err(&[("fp8-format", Value::from("hybrid"))]);
    assert!(e.contains("--fp8-format") && e.contains("e4m3"), "{e}");
    let e = err(&[("fp8-format", Value::from("e4m3")), ("fp8-recipe", Value::from("delayed"))]);
    assert!(e.contains("--fp8-recipe") && e.contains("blockwise"), "{e}");
    let dir = scratch("train_fp8_layers");
    let e = format!(
        "{:#}",
        rl::train(
            train_cmd::setup(
                train_cmd::run_config(&demo_args(&[
                    ("run-dir", Value::from(dir.to_str().unwrap())),
                    ("fp8-format", Value::from("e4m3")),
                    ("num-layers-at-start-in-bf16", Value::from(40)),
                ]))
                .unwrap()
            )
            .unwrap(),
            &mut |_| {}
        )
        .unwrap_err()
    );
    assert!(e.contains("--num-layers-at-start-in-bf16 40"), "{e}");
    let out = run_binary_with(
        &["--fp8-format", "e4m3", "--num-rollout", "1"],
        None,
        &[("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "0")],
    );
    assert!(!out.status.success());
    let t = text(&out);
    assert!(t.contains("NVTE_FP8_BLOCK_SCALING_FP32_SCALES=0") && t.contains("f32"), "{t}");
}

/// A two-turn generate function as slime writes them: the engine continues the prompt, a
/// tool's answer (tokenized by the server, masked out) is appended, and the engine continues
/// again; it returns the engine's logprobs of what it generated.
const TWO_TURNS: &str = r#"
from slime.utils.http_utils import post
from slime.utils.types import Sample

async def generate(args, sample, sampling_params):
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}"
    tokens, prompt = list(sample.tokens), len(sample.tokens)
    mask, logprobs = [], []
    for turn in range(2):
        out = await post(url + "/generate", {"input_ids": tokens, "return_logprob": True,
                                             "sampling_params": sampling_params})
        for logprob, token, _ in out["meta_info"]["output_token_logprobs"]:
            tokens.append(token); mask.append(1); logprobs.append(logprob)
        if turn == 0:
            tool = await post(url + "/tokenize", {"prompt": "<tool>", "add_special_tokens": False})
            tokens += tool["tokens"]; mask += [0] * len(tool["tokens"])
            logprobs += [0.0] * len(tool["tokens"])
    text = await post(url + "/detokenize", {"tokens": tokens[prompt:]})
    sample.tokens, sample.response_length = tokens, len(tokens) - prompt
    sample.response, sample.loss_mask, sample.rollout_log_probs = text["text"], mask, logprobs
    sample.status = Sample.Status.COMPLETED
    return sample

async def edits(args, sample, sampling_params):
    sample = await generate(args, sample, sampling_params)
    sample.tokens[-1] = (sample.tokens[-1] + 1) % 256
    return sample
"#;

/// `--custom-generate-function-path`: a multi-turn function trains with logprob gap 0 on the
/// engine's tokens (the tool's masked out), and a function that edits a generated token has
/// every sample refused, the position named; the calculator example runs.
#[test]
fn a_custom_generate_function_trains_multi_turn_samples_on_the_engines_tokens() {
    if Command::new("python3").arg("--version").output().is_err() {
        println!("skipping: no python3");
        return;
    }
    let dir = scratch("train_custom_generate");
    let file = dir.join("two_turns.py");
    std::fs::write(&file, TWO_TURNS).unwrap();
    let example = miles_tests::workspace_root().join("examples/calculator-tool/generate.py");
    for (file, function, trained) in
        [(&file, "generate", true), (&file, "edits", false), (&example, "generate", true)]
    {
        let run = dir.join(format!("{}-{function}", file.file_stem().unwrap().to_string_lossy()));
        let args = format!(
            "--sft-warmup-steps 5 --rollout-batch-size 4 --n-samples-per-prompt 2 \
             --num-rollout 2 --eval-interval 100 --rollout-max-response-len 6 --run-dir {} \
             --custom-generate-function-path {}:{function}",
            run.display(),
            file.display()
        );
        let out = run_binary(&args.split_whitespace().collect::<Vec<_>>(), None);
        let said = text(&out);
        assert!(out.status.success(), "{said}");
        let records = iteration_records(&run);
        if !trained {
            assert!(said.contains("8 samples failed, first: response token"), "{said}");
            assert!(said.contains("but the engine generated"), "{said}");
            assert!(records.iter().all(|r| r["rollout/failed"] == 8.0), "{records:?}");
            continue;
        }
        assert!(said.contains("(a Python generate function) calls the engine at"), "{said}");
        assert_eq!(records.len(), 2);
        for r in &records {
            assert_eq!(r["train/train_rollout_logprob_abs_diff"], 0.0, "{r}");
            assert_eq!(r["rollout/failed"], 0.0, "{r}");
        }
        if function == "generate" && file == &dir.join("two_turns.py") {
            // Concurrent samples reach the engine in any order; their draws are keyed by
            // sample and turn, so a second run is the same run.
            let again = dir.join("again");
            let args = args.replace(&run.display().to_string(), &again.display().to_string());
            let out = run_binary(&args.split_whitespace().collect::<Vec<_>>(), None);
            assert!(out.status.success(), "{}", text(&out));
            let same = |r: &Value| -> Value {
                let mut r = r.clone();
                r.as_object_mut()
                    .unwrap()
                    .retain(|k, _| !k.starts_with("perf/") && !k.contains("time"));
                r
            };
            let twice: Vec<Value> = iteration_records(&again).iter().map(same).collect();
            assert_eq!(records.iter().map(same).collect::<Vec<_>>(), twice);
        }
    }
}
