//! `--custom-generate-function-path FILE.py:FUNCTION`: slime's custom generate function
//! ([`miles_rewards::PythonGenerate`]) makes each sample, calling the embedded engine over
//! HTTP ([`miles_server`] on 127.0.0.1, its address in the function's `args`) as many times as
//! it likes (multi-turn, tools). During a rollout the engine serves those requests on the
//! trainer's thread with the policy lent ([`miles_rollout::Lent::serve`]), so they batch
//! together and their logprobs are the trainer's bit for bit. Requests the worker's `post`
//! named by sample and turn are keyed so (their draws), so a run repeats exactly however the
//! function's concurrent requests interleave.
//!
//! Every request the engine answers is recorded; a returned sample is trained only if each
//! token it trains on (loss mask 1) is one the engine generated right after exactly the
//! sample's tokens before it, and any logprob the function returns for it is the engine's,
//! bit for bit. So re-tokenizing a turn's text (drift) or editing a generated token is found
//! and the sample fails with the position named, never trained. The engine's logprobs fill in
//! where the function gives none.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};

use anyhow::Context;
use miles_core::{Rollout, Sample, SamplingParams, Status};
use miles_model::Tokenizer;
use miles_rewards::{Generated, PythonGenerate, PythonRewardConfig, python_spec};
use miles_rollout::{Job, Lent};
use serde_json::{Value, json};

/// What the engine generated during a rollout: per request's prompt tokens, its outputs
/// (tokens, logprobs); several for one prompt when it was asked more than once.
type EngineLog = HashMap<Vec<u32>, Vec<(Vec<u32>, Vec<f32>)>>;

/// The generate function with the engine's HTTP face.
pub(super) struct CustomGenerate {
    function: PythonGenerate,
    /// The requests the HTTP side took (recorded), for the engine to serve during a rollout.
    jobs: Mutex<Receiver<Job>>,
    /// Into `jobs`: ends a rollout's serving once the function is done.
    stop: Sender<Job>,
    log: Arc<Mutex<EngineLog>>,
    /// The rollout's seed, which keys the draws of every request during it.
    seed: Arc<AtomicU64>,
}

impl CustomGenerate {
    /// Binds the engine's HTTP server on a free local port and starts the function's worker
    /// with the server's address in its `args`.
    pub(super) fn start(
        cfg: &miles_core::config::RunConfig,
        tokenizer: &Tokenizer,
    ) -> anyhow::Result<Self> {
        let spec = cfg.custom_generate_function_path.as_deref().unwrap_or_default();
        let (file, function) = match python_spec(spec) {
            // (slime's default name, not a reward's.)
            Some((file, _)) if spec.ends_with(".py") => (file, "generate".to_string()),
            Some(found) => found,
            None => anyhow::bail!("--custom-generate-function-path {spec}: give FILE.py:FUNCTION"),
        };
        let listener = std::net::TcpListener::bind(("127.0.0.1", 0))
            .context("--custom-generate-function-path: a local port for the engine's server")?;
        let port = listener.local_addr()?.port();
        let (http, requests) = channel();
        let (stop, jobs) = channel();
        let log: Arc<Mutex<EngineLog>> = Arc::default();
        let seed = Arc::new(AtomicU64::new(cfg.rollout_seed));
        relay(requests, stop.clone(), Arc::clone(&log), Arc::clone(&seed));
        let name = cfg.hf_checkpoint.as_ref().map_or("policy".into(), |p| p.display().to_string());
        let router = miles_server::router(http, Some(tokenizer.clone()), name, cfg.rollout_seed);
        std::thread::spawn(move || {
            if let Err(e) = miles_server::serve_blocking(listener, router) {
                eprintln!("--custom-generate-function-path: the engine's HTTP server stopped: {e}");
            }
        });
        // The run's rollout settings as slime's args has them, and a worker timeout that
        // allows for a long multi-turn sample.
        let args = json!({
            "sglang_router_ip": "127.0.0.1",
            "sglang_router_port": port,
            "rollout_max_response_len": cfg.rollout_max_response_len,
            "rollout_temperature": cfg.rollout_temperature,
            "rollout_top_p": cfg.rollout_top_p,
            "rollout_top_k": cfg.rollout_top_k,
            "n_samples_per_prompt": cfg.n_samples_per_prompt,
            "apply_chat_template": cfg.apply_chat_template,
            "timeout_secs": 600,
        });
        let config = PythonRewardConfig::from_json(&args)?;
        let function = PythonGenerate::start(&file, &function, cfg.rm_python.clone(), config)?;
        eprintln!(
            "rollout: {} (a Python generate function) calls the engine at http://127.0.0.1:{port}",
            function.label()
        );
        Ok(CustomGenerate { function, jobs: Mutex::new(jobs), stop, log, seed })
    }

    /// The rollout: the function over the samples while the lent engine serves its requests.
    pub(super) fn rollout<'a>(&'a self, lent: Lent<'a>) -> CustomRollout<'a> {
        CustomRollout { lent, custom: self }
    }
}

/// Forwards the HTTP side's jobs to the engine's queue, recording what each request got.
fn relay(
    requests: Receiver<Job>,
    jobs: Sender<Job>,
    log: Arc<Mutex<EngineLog>>,
    seed: Arc<AtomicU64>,
) {
    std::thread::spawn(move || {
        for job in requests {
            let job = match job {
                Job::Generate(mut r) => {
                    r.params.seed = seed.load(Ordering::Relaxed);
                    r.key = r.rid.as_deref().and_then(sample_key);
                    let (reply, log) = (r.reply, Arc::clone(&log));
                    r.reply = Box::new(move |result: miles_core::Result<Vec<Sample>>| {
                        if let Ok(samples) = &result {
                            record(&mut log.lock().unwrap_or_else(|p| p.into_inner()), samples);
                        }
                        reply(result)
                    });
                    Job::Generate(r)
                }
                other => other,
            };
            if jobs.send(job).is_err() {
                return;
            }
        }
    });
}

/// The draws' key of a request the worker named for its sample and turn
/// (`miles-sample-{index}-{turn}`, worker.py's `post`): the same draws whatever order the
/// samples' requests reach the engine in. (The top bit keeps them apart from the arrival
/// counts of requests named otherwise.)
fn sample_key(rid: &str) -> Option<usize> {
    let (index, turn) = rid.strip_prefix("miles-sample-")?.split_once('-')?;
    let (index, turn): (usize, usize) = (index.parse().ok()?, turn.parse().ok()?);
    // (Bits: the index above 30, the turn from 10, the request's n samples below.)
    (index < 1 << 31 && turn < 1 << 20).then_some(1 << 63 | index << 30 | turn << 10)
}

fn record(log: &mut EngineLog, samples: &[Sample]) {
    for s in samples {
        let Ok(p) = s.prompt_length() else { continue };
        let out = (s.tokens[p..].to_vec(), s.rollout_log_probs.clone());
        log.entry(s.tokens[..p].to_vec()).or_default().push(out);
    }
}

/// A rollout through the generate function ([`CustomGenerate::rollout`]).
pub(super) struct CustomRollout<'a> {
    lent: Lent<'a>,
    custom: &'a CustomGenerate,
}

impl Rollout for CustomRollout<'_> {
    fn generate(
        &mut self,
        groups: Vec<Vec<Sample>>,
        params: &SamplingParams,
    ) -> miles_core::Result<Vec<Vec<Sample>>> {
        let custom = self.custom;
        let jobs = custom.jobs.lock().unwrap_or_else(|p| p.into_inner());
        // A stop left by a rollout whose serving failed.
        while jobs.try_recv().is_ok() {}
        custom.log.lock().unwrap_or_else(|p| p.into_inner()).clear();
        custom.seed.store(params.seed, Ordering::Relaxed);
        let sizes: Vec<usize> = groups.iter().map(Vec::len).collect();
        let flat: Vec<Sample> = groups.into_iter().flatten().collect();
        let sampling = sglang_params(params);
        let (served, results) = std::thread::scope(|scope| {
            let worker = scope.spawn(|| {
                let results = custom.function.generate(&flat, &sampling);
                let _ = custom.stop.send(Job::Stop);
                results
            });
            let served = self.lent.serve(&jobs);
            if let Err(e) = &served {
                // The engine failed: the function's requests from now on are refused, so that
                // it ends instead of waiting for answers.
                while !worker.is_finished() {
                    if let Ok(job) = jobs.recv_timeout(std::time::Duration::from_millis(20)) {
                        refuse(job, &e.to_string());
                    }
                }
            }
            (served, worker.join())
        });
        served?;
        let results = results.map_err(|_| {
            miles_core::Error::Plugin(
                "--custom-generate-function-path: the worker thread panicked".into(),
            )
        })?;
        if let Some(why) = custom.function.fatal() {
            return Err(miles_core::Error::Plugin(why));
        }
        let log = std::mem::take(&mut *custom.log.lock().unwrap_or_else(|p| p.into_inner()));
        let version = self.lent.weight_version();
        let mut out = flat.into_iter().zip(results).map(|(s, r)| finish(s, r, &log, version));
        let groups = sizes.iter().map(|&n| out.by_ref().take(n).collect()).collect();
        Ok(groups)
    }

    fn set_weight_version(&mut self, version: u64) {
        self.lent.set_weight_version(version);
    }
}

/// Answers `job` with the engine's failure.
fn refuse(job: Job, why: &str) {
    let failed = || miles_core::Error::Invalid(format!("the rollout engine failed: {why}"));
    match job {
        Job::Generate(r) => (r.reply)(Err(failed())),
        Job::LoadWeights { reply, .. } => reply(Err(failed())),
        Job::Abort { .. } | Job::Stop => {}
    }
}

/// SGLang's `sampling_params` of the rollout's.
fn sglang_params(p: &SamplingParams) -> Value {
    json!({
        "temperature": p.temperature,
        "top_p": p.top_p,
        "top_k": if p.top_k == 0 { -1 } else { p.top_k as i64 },
        "max_new_tokens": p.max_new_tokens,
        "stop": p.stop,
        "ignore_eos": p.ignore_eos,
        "skip_special_tokens": true,
    })
}

/// `sample` as the function returned it, checked against the engine's `log`; failed with
/// the reason where the function failed or the check does.
fn finish(
    mut sample: Sample,
    result: Result<Generated, String>,
    log: &EngineLog,
    version: u64,
) -> Sample {
    let checked = result.and_then(|g| {
        let mask = g.loss_mask.clone().unwrap_or_else(|| vec![1; g.response_length]);
        let logprobs = match g.status {
            Status::Failed => vec![0.0; g.response_length],
            _ => engine_logprobs(
                &g.tokens,
                g.response_length,
                &mask,
                g.rollout_log_probs.as_deref(),
                log,
            )?,
        };
        Ok((g, mask, logprobs))
    });
    match checked {
        Ok((g, mask, logprobs)) => {
            sample.tokens = g.tokens;
            sample.response_length = g.response_length;
            sample.response = g.response;
            sample.status = g.status;
            sample.loss_mask = mask;
            sample.rollout_log_probs = logprobs;
            sample.weight_version = version;
            if let Some(m) = g.metadata {
                sample.metadata = m;
            }
        }
        Err(why) => {
            sample.status = Status::Failed;
            if !sample.metadata.is_object() {
                sample.metadata = json!({});
            }
            sample.metadata["rollout_error"] = why.into();
        }
    }
    sample
}

/// The rollout logprob of every response token of `tokens` (the last `response` of them):
/// a trained one (mask 1) must be a token the engine generated right after exactly the
/// tokens before it, its logprob the engine's (`given`, where the function gave them, must
/// equal them bit for bit); an untrained one keeps the function's, or 0.
fn engine_logprobs(
    tokens: &[u32],
    response: usize,
    mask: &[u8],
    given: Option<&[f32]>,
    log: &EngineLog,
) -> Result<Vec<f32>, String> {
    let start = tokens.len() - response;
    let mut out: Vec<f32> = given.map_or_else(|| vec![0.0; response], <[f32]>::to_vec);
    let mut i = 0;
    while i < response {
        if mask[i] == 0 {
            i += 1;
            continue;
        }
        let at = start + i;
        let Some(answers) = log.get(&tokens[..at]) else {
            return Err(format!(
                "response token {i} (id {}) is trained on, but the engine was never asked to \
                 continue the {at} tokens before it (were they re-tokenized from text? is it a \
                 tool's output, to mask with loss_mask 0?)",
                tokens[at]
            ));
        };
        // The answer that generated the most of what follows.
        let run = |(out, _): &(Vec<u32>, Vec<f32>)| {
            out.iter()
                .zip(&tokens[at..])
                .zip(&mask[i..])
                .take_while(|((a, b), m)| a == b && **m == 1)
                .count()
        };
        let (best, kept) =
            answers.iter().map(|a| (a, run(a))).max_by_key(|&(_, n)| n).expect("a recorded answer");
        if kept == 0 {
            return Err(format!(
                "response token {i} is {}, but the engine generated {} after the same tokens",
                tokens[at],
                best.0.first().map_or("nothing".into(), |t| t.to_string())
            ));
        }
        for j in 0..kept {
            let engine = best.1[j];
            if let Some(g) = given
                && g[i + j].to_bits() != engine.to_bits()
            {
                return Err(format!(
                    "response token {}: rollout_log_probs gives {}, the engine's is {engine}",
                    i + j,
                    g[i + j]
                ));
            }
            out[i + j] = engine;
        }
        i += kept;
        if i < response && mask[i] == 1 && kept < best.0.len() {
            return Err(format!(
                "response token {i} is {}, but the engine generated {} after the same tokens",
                tokens[start + i],
                best.0[kept]
            ));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two turns with a tool's output between them: trained where the engine generated,
    /// the tool's tokens untrained; re-tokenized or edited tokens, and logprobs not the
    /// engine's, named by position.
    #[test]
    fn trained_tokens_must_be_the_engines_after_exactly_the_same_tokens() {
        let mut log = EngineLog::new();
        log.entry(vec![1, 2]).or_default().push((vec![10, 11], vec![-0.5, -0.25]));
        log.entry(vec![1, 2, 10, 11, 50, 51]).or_default().push((vec![12], vec![-1.5]));
        // prompt [1, 2], turn [10, 11], tool [50, 51], turn [12]
        let tokens = [1, 2, 10, 11, 50, 51, 12];
        let mask = [1, 1, 0, 0, 1];
        let got = engine_logprobs(&tokens, 5, &mask, None, &log).unwrap();
        assert_eq!(got, [-0.5, -0.25, 0.0, 0.0, -1.5]);
        let given = [-0.5, -0.25, 7.0, 7.0, -1.5];
        assert_eq!(engine_logprobs(&tokens, 5, &mask, Some(&given), &log).unwrap(), given);
        // The tool's tokens trained on.
        let e = engine_logprobs(&tokens, 5, &[1, 1, 1, 0, 1], None, &log).unwrap_err();
        assert!(e.contains("response token 2 (id 50) is trained on") && e.contains("mask"), "{e}");
        // A generated token edited.
        let edited = [1, 2, 13, 11, 50, 51, 12];
        let e = engine_logprobs(&edited, 5, &mask, None, &log).unwrap_err();
        assert!(e.contains("response token 0 is 13, but the engine generated 10"), "{e}");
        // The second turn's prefix re-tokenized differently.
        let drifted = [1, 2, 10, 11, 50, 52, 12];
        let e = engine_logprobs(&drifted, 5, &mask, None, &log).unwrap_err();
        assert!(e.contains("response token 4 (id 12)") && e.contains("re-tokenized"), "{e}");
        let e = engine_logprobs(&tokens, 5, &mask, Some(&[-0.5, -0.3, 0.0, 0.0, -1.5]), &log);
        assert!(e.unwrap_err().contains("response token 1: rollout_log_probs gives -0.3"));
        // A turn cut short by the function is fine: what is trained is the engine's.
        let cut = [1, 2, 10];
        assert_eq!(engine_logprobs(&cut, 1, &[1], None, &log).unwrap(), [-0.5]);
    }

    /// The worker's request names key the draws by sample and turn, apart from each other
    /// and from arrival counts; other names key nothing.
    #[test]
    fn request_names_key_draws_by_sample_and_turn() {
        let keys: Vec<usize> = [(0, 0), (0, 1), (1, 0), (7, 3)]
            .iter()
            .map(|(i, t)| sample_key(&format!("miles-sample-{i}-{t}")).unwrap())
            .collect();
        let distinct: std::collections::HashSet<_> = keys.iter().collect();
        assert_eq!(distinct.len(), 4);
        // Room for a request's n samples between turns, and far from arrival counts.
        assert!(keys.iter().all(|&k| k >= 1 << 63 && k % 1024 == 0));
        for rid in ["r1", "miles-sample-1", "miles-sample-x-0", "miles-sample-1-2-3"] {
            assert_eq!(sample_key(rid), None, "{rid}");
        }
    }
}
