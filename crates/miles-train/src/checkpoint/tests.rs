use super::*;
use miles_model::{Architecture, Tokenizer, presets, tokenizer};
use serde_json::json;

const HYPER: AdamW = AdamW { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.1 };

/// A fresh, empty directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let p =
            std::env::temp_dir().join(format!("miles-ckpt-{tag}-{}-{nanos}", std::process::id()));
        let _ = fs::remove_dir_all(&p);
        fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// A model after `steps` real AdamW steps (so the moments are non-zero).
struct Run {
    config: ModelConfig,
    weights: Weights,
    opt: Optimizer,
}

impl Run {
    fn new(steps: u64) -> Self {
        Self::of(presets::preset("tiny", None).unwrap(), steps)
    }

    fn of(config: ModelConfig, steps: u64) -> Self {
        let mut run = Run {
            weights: Weights::random(&config, 1),
            opt: Optimizer::new(&config, HYPER, 1.0),
            config,
        };
        for s in 0..steps {
            run.step(100 + s);
        }
        run
    }

    fn step(&mut self, seed: u64) {
        let mut grads = Weights::random(&self.config, seed);
        self.opt.step(&mut self.weights, &mut grads, HYPER.lr).unwrap();
    }

    fn save(&self, root: &Path, iteration: u64, state: &serde_json::Value) -> Result<PathBuf> {
        let ckpt = CheckpointRef {
            config: &self.config,
            weights: &self.weights,
            optimizer: &self.opt,
            state,
            tokenizer_dir: None,
            extra: &[],
            draft: None,
        };
        save(root, iteration, &ckpt)
    }
}

fn bits(w: &Weights) -> Vec<Vec<u32>> {
    w.tensors().iter().map(|t| t.iter().map(|x| x.to_bits()).collect()).collect()
}

fn names_in(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// A speculative draft and its moments are saved in the draft's own format (a directory
/// `--sglang-speculative-draft-model-path` reads) and load back bit for bit; a checkpoint
/// without one loads without one.
#[test]
fn a_draft_and_its_moments_round_trip() {
    use miles_model::draft::{Draft, DraftFormat};
    let tmp = TempDir::new("draft");
    let run = Run::new(1);
    let drafts: Vec<Draft> =
        (0..3).map(|seed| Draft::random(&run.config, DraftFormat::MiMo, seed).unwrap()).collect();
    let state = DraftState {
        draft: drafts[0].clone(),
        moments: Some((drafts[1].clone(), drafts[2].clone(), 5)),
    };
    let ckpt = CheckpointRef {
        config: &run.config,
        weights: &run.weights,
        optimizer: &run.opt,
        state: &json!({}),
        tokenizer_dir: None,
        extra: &[],
        draft: Some(&state),
    };
    let dir = save(&tmp.0, 3, &ckpt).unwrap();
    assert_eq!(Draft::load(&dir.join(DRAFT_DIR), &run.config).unwrap(), drafts[0]);
    assert_eq!(load(&tmp.0, HYPER, 1.0, &[]).unwrap().draft, Some(state));
    run.save(&tmp.0, 4, &json!({})).unwrap();
    assert_eq!(load(&tmp.0, HYPER, 1.0, &[]).unwrap().draft, None);
}

/// GLM-4's files differ from memory (fused gate_up, renamed norms, q/k rows reordered): the
/// model and both moments are written in its file layout and read back bit for bit.
#[test]
fn a_glm4_checkpoint_is_in_its_file_layout_and_loads_back_bit_for_bit() {
    let tmp = TempDir::new("glm4");
    let run = Run::of(presets::preset("tiny", Some(Architecture::Glm4)).unwrap(), 2);
    let dir = run.save(&tmp.0, 2, &json!({})).unwrap();
    for (file, name) in [
        (MODEL_FILE, "model.layers.1.mlp.gate_up_proj.weight".to_string()),
        (OPTIMIZER_FILE, format!("{EXP_AVG}model.layers.0.post_mlp_layernorm.weight")),
        (OPTIMIZER_FILE, format!("{EXP_AVG_SQ}model.layers.0.mlp.gate_up_proj.weight")),
    ] {
        let bytes = fs::read(dir.join(file)).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        assert!(st.tensor(&name).is_ok(), "{file} lacks {name}");
    }
    let loaded = load(&tmp.0, HYPER, 1.0, &[]).unwrap();
    assert_eq!(bits(&loaded.weights), bits(&run.weights));
    let ((m0, v0), (m1, v1)) = (run.opt.moments(), loaded.optimizer.moments());
    assert_eq!((bits(m1), bits(v1)), (bits(m0), bits(v0)));
}

#[test]
fn round_trip_is_bit_identical_and_resume_continues_exactly() {
    let tmp = TempDir::new("roundtrip");
    let (root, tok) = (tmp.0.join("ckpt"), tmp.0.join("tok"));
    fs::create_dir_all(&tok).unwrap();
    tokenizer::write_byte_level_tokenizer(&tok).unwrap();
    let mut run = Run::new(3);
    let (m, v) = run.opt.moments();
    assert!(m.embed.iter().any(|x| *x != 0.0) && v.embed.iter().any(|x| *x != 0.0));
    let reference = Weights::random(&run.config, 99);
    let state = json!({"rollout_id": 7, "data": {"epoch": 1, "offset": 96}, "reward": 0.5});
    let extra = [("ref", &reference)];
    let ckpt = CheckpointRef {
        config: &run.config,
        weights: &run.weights,
        optimizer: &run.opt,
        state: &state,
        tokenizer_dir: Some(&tok),
        extra: &extra,
        draft: None,
    };
    let dir = save(&root, 10, &ckpt).unwrap();
    assert_eq!(dir, root.join("iter_0000010"));
    assert_eq!(latest_iteration(&root).unwrap(), Some(10));
    assert_eq!(fs::read_to_string(root.join(POINTER_FILE)).unwrap(), "10");
    assert_eq!(
        names_in(&dir),
        [
            "checksums.json",
            "config.json",
            "model.safetensors",
            "optimizer.safetensors",
            "ref.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
            "trainer_state.json"
        ]
    );
    assert_eq!(names_in(&root), ["iter_0000010", POINTER_FILE]);
    // The iteration dir is a plain HF model dir too.
    assert!(Tokenizer::load(&dir).unwrap().has_chat_template());
    assert_eq!(Weights::load(&dir, &run.config).unwrap(), run.weights);

    let loaded = load(&root, HYPER, 1.0, &["ref"]).unwrap();
    assert_eq!(loaded.iteration, 10);
    assert_eq!(loaded.dir, dir);
    assert_eq!(loaded.config, run.config);
    assert_eq!(bits(&loaded.weights), bits(&run.weights));
    let ((m0, v0), (m1, v1)) = (run.opt.moments(), loaded.optimizer.moments());
    assert_eq!(bits(m1), bits(m0));
    assert_eq!(bits(v1), bits(v0));
    assert_eq!(loaded.optimizer.steps(), 3);
    assert_eq!(loaded.state, state);
    assert_eq!(loaded.extra.len(), 1);
    assert_eq!(loaded.extra[0].0, "ref");
    assert_eq!(bits(&loaded.extra[0].1), bits(&reference));

    // The same next step from the original and the resumed state gives the same bits.
    let mut resumed = Run { config: loaded.config, weights: loaded.weights, opt: loaded.optimizer };
    run.step(500);
    resumed.step(500);
    assert_eq!(bits(&resumed.weights), bits(&run.weights));
    assert_eq!(bits(resumed.opt.moments().1), bits(run.opt.moments().1));
    assert_eq!(resumed.opt.steps(), 4);
}

#[test]
fn a_stale_tmp_dir_is_ignored_by_load_and_cleaned_by_the_next_save() {
    let tmp = TempDir::new("stale");
    let root = tmp.0.clone();
    let run = Run::new(1);
    run.save(&root, 1, &json!({"at": 1})).unwrap();
    // A save of iteration 2 "crashed" half-way: garbage in its temp dir, no pointer move.
    let stale = root.join(".iter_0000002.tmp");
    fs::create_dir_all(stale.join("sub")).unwrap();
    fs::write(stale.join("model.safetensors"), b"garbage").unwrap();
    fs::write(stale.join("sub/junk"), b"junk").unwrap();
    let loaded = load(&root, HYPER, 1.0, &[]).unwrap();
    assert_eq!((loaded.iteration, loaded.state), (1, json!({"at": 1})));

    let dir = run.save(&root, 2, &json!({"at": 2})).unwrap();
    assert!(!present(&stale));
    assert_eq!(names_in(&root), ["iter_0000001", "iter_0000002", POINTER_FILE]);
    assert!(!names_in(&dir).contains(&"sub".to_string()));
    let loaded = load(&root, HYPER, 1.0, &[]).unwrap();
    assert_eq!((loaded.iteration, loaded.state), (2, json!({"at": 2})));
}

#[test]
fn re_saving_the_same_iteration_replaces_it() {
    let tmp = TempDir::new("resave");
    let root = tmp.0.clone();
    let mut run = Run::new(1);
    run.save(&root, 5, &json!({"version": 1})).unwrap();
    run.step(7);
    run.save(&root, 5, &json!({"version": 2})).unwrap();
    assert_eq!(names_in(&root), ["iter_0000005", POINTER_FILE]);
    let loaded = load(&root, HYPER, 1.0, &[]).unwrap();
    assert_eq!(loaded.state, json!({"version": 2}));
    assert_eq!(loaded.optimizer.steps(), 2);
    assert_eq!(loaded.weights, run.weights);
}

#[test]
fn a_crash_between_the_renames_of_a_re_save_still_loads_the_old_copy() {
    let tmp = TempDir::new("oldcopy");
    let root = tmp.0.clone();
    let run = Run::new(1);
    let dir = run.save(&root, 5, &json!({"version": 1})).unwrap();
    // The state right after `iter_0000005` was moved aside and before the new one moved in.
    fs::rename(&dir, root.join(".iter_0000005.old")).unwrap();
    let loaded = load(&root, HYPER, 1.0, &[]).unwrap();
    assert_eq!(loaded.state, json!({"version": 1}));
    run.save(&root, 5, &json!({"version": 2})).unwrap();
    assert_eq!(names_in(&root), ["iter_0000005", POINTER_FILE]);
    assert_eq!(load(&root, HYPER, 1.0, &[]).unwrap().state, json!({"version": 2}));
}

#[test]
fn the_pointer_moves_only_after_the_directory_is_complete() {
    let tmp = TempDir::new("pointer");
    let root = tmp.0.clone();
    let mut run = Run::new(1);
    run.save(&root, 1, &json!({"at": 1})).unwrap();
    // A file where the temp dir of iteration 2 must go makes that save fail early.
    let blocker = root.join(".iter_0000002.tmp");
    fs::write(&blocker, b"in the way").unwrap();
    run.step(3);
    let err = run.save(&root, 2, &json!({"at": 2})).unwrap_err().to_string();
    assert!(err.contains(".iter_0000002.tmp") && err.contains("not a directory"), "{err}");
    assert_eq!(latest_iteration(&root).unwrap(), Some(1));
    assert!(!present(&root.join("iter_0000002")));
    let loaded = load(&root, HYPER, 1.0, &[]).unwrap();
    assert_eq!((loaded.iteration, loaded.optimizer.steps()), (1, 1));
    // Once it is out of the way, the save goes through.
    fs::remove_file(&blocker).unwrap();
    run.save(&root, 2, &json!({"at": 2})).unwrap();
    assert_eq!(latest_iteration(&root).unwrap(), Some(2));
}

#[test]
fn a_malformed_pointer_is_an_error_naming_it() {
    let tmp = TempDir::new("malformed");
    fs::write(tmp.0.join(POINTER_FILE), "release\n").unwrap();
    let err = latest_iteration(&tmp.0).unwrap_err().to_string();
    assert!(err.contains(POINTER_FILE) && err.contains("'release'"), "{err}");
    let err = load(&tmp.0, HYPER, 1.0, &[]).unwrap_err().to_string();
    assert!(err.contains(POINTER_FILE), "{err}");
    // Whitespace around the number is fine (other tools write a newline).
    fs::write(tmp.0.join(POINTER_FILE), "12\n").unwrap();
    assert_eq!(latest_iteration(&tmp.0).unwrap(), Some(12));
    // A pointer to a missing directory names both.
    let err = load(&tmp.0, HYPER, 1.0, &[]).unwrap_err().to_string();
    assert!(err.contains(POINTER_FILE) && err.contains("iter_0000012"), "{err}");
}

#[test]
fn loading_without_a_checkpoint_says_what_to_do() {
    let tmp = TempDir::new("empty");
    assert_eq!(latest_iteration(&tmp.0).unwrap(), None);
    let err = load(&tmp.0, HYPER, 1.0, &[]).unwrap_err().to_string();
    assert!(err.contains(&tmp.0.display().to_string()), "{err}");
    assert!(err.contains("drop --load") && err.contains(POINTER_FILE), "{err}");
    let missing = tmp.0.join("nowhere");
    assert_eq!(latest_iteration(&missing).unwrap(), None);
}

#[test]
fn damaged_files_are_errors_naming_them() {
    let tmp = TempDir::new("damaged");
    let root = tmp.0.clone();
    let run = Run::new(2);
    let dir = run.save(&root, 3, &json!({})).unwrap();
    let config = &run.config;
    // (The parsers behind the checksums: as a checkpoint of an earlier version, without them.)
    fs::remove_file(dir.join(manifest::MANIFEST_FILE)).unwrap();

    // An extra weight set that was never saved.
    let err = load(&root, HYPER, 1.0, &["ref"]).unwrap_err().to_string();
    assert!(err.contains("ref.safetensors") && err.contains("missing"), "{err}");

    // A tensor missing from optimizer.safetensors.
    let opt_path = dir.join(OPTIMIZER_FILE);
    let (m, v) = run.opt.moments();
    let mut tensors = named(config, m, EXP_AVG);
    tensors.extend(named(config, v, EXP_AVG_SQ));
    tensors.retain(|(n, _)| n != "exp_avg_sq.model.norm.weight");
    let meta = HashMap::from([(STEP_KEY.to_string(), "2".to_string())]);
    write_tensors(&opt_path, tensors, meta).unwrap();
    let err = load(&root, HYPER, 1.0, &[]).unwrap_err().to_string();
    assert!(err.contains(OPTIMIZER_FILE), "{err}");
    assert!(err.contains("'exp_avg_sq.model.norm.weight' is missing"), "{err}");

    // No step in the metadata.
    let mut tensors = named(config, m, EXP_AVG);
    tensors.extend(named(config, v, EXP_AVG_SQ));
    write_tensors(&opt_path, tensors, pt_metadata()).unwrap();
    let err = load(&root, HYPER, 1.0, &[]).unwrap_err().to_string();
    assert!(err.contains(OPTIMIZER_FILE) && err.contains("step"), "{err}");

    // Unreadable trainer state.
    let mut tensors = named(config, m, EXP_AVG);
    tensors.extend(named(config, v, EXP_AVG_SQ));
    let meta = HashMap::from([(STEP_KEY.to_string(), "2".to_string())]);
    write_tensors(&opt_path, tensors, meta).unwrap();
    assert_eq!(load(&root, HYPER, 1.0, &[]).unwrap().optimizer.steps(), 2);
    fs::write(dir.join(STATE_FILE), "{\"rollout_id\": ").unwrap();
    let err = load(&root, HYPER, 1.0, &[]).unwrap_err().to_string();
    assert!(err.contains(STATE_FILE) && err.contains("not valid JSON"), "{err}");
}

#[test]
fn bad_arguments_are_refused_before_anything_is_written() {
    let tmp = TempDir::new("badargs");
    let root = tmp.0.join("ckpt");
    let run = Run::new(0);
    let state = json!({});
    for name in ["model", "optimizer", "", ".hidden", "a/b"] {
        let extra = [(name, &run.weights)];
        let ckpt = CheckpointRef {
            config: &run.config,
            weights: &run.weights,
            optimizer: &run.opt,
            state: &state,
            tokenizer_dir: None,
            extra: &extra,
            draft: None,
        };
        let err = save(&root, 1, &ckpt).unwrap_err().to_string();
        assert!(err.contains(&format!("'{name}'")), "{err}");
    }
    let llama = presets::preset("tiny", Some(Architecture::Llama)).unwrap();
    let wrong = Weights::zeros(&llama);
    let ckpt = CheckpointRef {
        config: &run.config,
        weights: &wrong,
        optimizer: &run.opt,
        state: &state,
        tokenizer_dir: None,
        extra: &[],
        draft: None,
    };
    let err = save(&root, 1, &ckpt).unwrap_err().to_string();
    assert!(err.contains("the weights"), "{err}");
    // A tokenizer dir without tokenizer.json names the file.
    let ckpt = CheckpointRef { weights: &run.weights, tokenizer_dir: Some(&tmp.0), ..ckpt };
    let err = save(&root, 1, &ckpt).unwrap_err().to_string();
    assert!(err.contains("tokenizer.json"), "{err}");
    assert_eq!(latest_iteration(&root).unwrap(), None);
}

#[test]
fn export_hf_writes_a_model_dir_that_loads_back() {
    let tmp = TempDir::new("export");
    let (out, tok) = (tmp.0.join("hf/final"), tmp.0.join("tok"));
    fs::create_dir_all(&tok).unwrap();
    tokenizer::write_byte_level_tokenizer(&tok).unwrap();
    fs::write(tok.join("generation_config.json"), "{\"eos_token_id\": 258}").unwrap();
    let run = Run::new(2);
    export_hf(&out, &run.config, &run.weights, Some(&tok), None, None).unwrap();
    assert!(manifest::verify(&out).unwrap(), "an export carries its checksums");
    assert_eq!(
        names_in(&out),
        [
            "checksums.json",
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json"
        ]
    );
    let config = ModelConfig::from_file(&config_path(&out)).unwrap();
    assert_eq!(config, run.config);
    assert_eq!(bits(&Weights::load(&out, &config).unwrap()), bits(&run.weights));
    Tokenizer::load(&out).unwrap();

    // Exporting again replaces the dir and leaves nothing beside it.
    let other = Weights::random(&run.config, 5);
    export_hf(&out, &run.config, &other, None, None, None).unwrap();
    assert_eq!(names_in(&out), ["checksums.json", "config.json", "model.safetensors"]);
    assert_eq!(Weights::load(&out, &config).unwrap(), other);
    assert_eq!(names_in(&tmp.0.join("hf")), ["final"]);
}

/// A byte flipped anywhere in a checkpoint, in any of its files (the manifest itself
/// included), is an error naming that file, and the checkpoint loads again once the byte is
/// back; a file removed or added after the save is named too. `load_intact` then resumes
/// from the newest intact checkpoint before a damaged one, saying which it skipped.
#[test]
fn a_flipped_bit_in_any_file_is_named_and_the_fallback_skips_it() {
    let tmp = TempDir::new("flipped");
    let root = tmp.0.clone();
    let mut run = Run::new(1);
    run.save(&root, 2, &json!({"at": 2})).unwrap();
    run.step(7);
    let dir = run.save(&root, 4, &json!({"at": 4})).unwrap();
    let files = manifest_files(&dir);
    assert!(files.len() >= 4 && files.iter().any(|f| f == "checksums.json"), "{files:?}");
    for file in &files {
        let path = dir.join(file);
        let original = fs::read(&path).unwrap();
        let mut flipped = original.clone();
        let at = flipped.len() / 2;
        flipped[at] ^= 0x10;
        fs::write(&path, &flipped).unwrap();
        let err = load(&root, HYPER, 1.0, &[]).err().unwrap_or_else(|| panic!("{file}: loaded"));
        assert!(err.to_string().contains(file.as_str()), "{file}: {err}");
        fs::write(&path, &original).unwrap();
        load(&root, HYPER, 1.0, &[]).unwrap();
    }
    fs::write(dir.join("stray.txt"), "x").unwrap();
    let err = load(&root, HYPER, 1.0, &[]).unwrap_err().to_string();
    assert!(err.contains("stray.txt") && err.contains("not in checksums.json"), "{err}");
    fs::remove_file(dir.join("stray.txt")).unwrap();
    let state = fs::read(dir.join(STATE_FILE)).unwrap();
    fs::remove_file(dir.join(STATE_FILE)).unwrap();
    let err = load(&root, HYPER, 1.0, &[]).unwrap_err();
    assert!(matches!(err, Error::Damaged { .. }) && err.to_string().contains("missing"), "{err}");
    // The fallback: iteration 4 is damaged, 2 loads.
    let (loaded, skipped) = load_intact(&root, HYPER, 1.0, &[]).unwrap();
    assert_eq!((loaded.iteration, loaded.state["at"].as_u64()), (2, Some(2)));
    assert_eq!(skipped.len(), 1);
    assert!(skipped[0].0 == 4 && skipped[0].1.to_string().contains(STATE_FILE));
    fs::write(dir.join(STATE_FILE), state).unwrap();
    let (loaded, skipped) = load_intact(&root, HYPER, 1.0, &[]).unwrap();
    assert_eq!((loaded.iteration, skipped.len()), (4, 0));
}

/// Every file under `dir`, relative, sorted.
fn manifest_files(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push(p.strip_prefix(dir).unwrap().to_string_lossy().into_owned());
            }
        }
    }
    out.sort();
    out
}

#[test]
fn a_disk_filling_up_mid_save_removes_the_partial_files_and_names_the_bytes() {
    let tmp = TempDir::new("enospc");
    let dir = tmp.0.join(".iter_0000004.tmp");
    fs::create_dir(&dir).unwrap();
    let full = dir.join(OPTIMIZER_FILE);
    let e = writing(&dir, 123_456_789, || {
        write_synced(&dir.join(MODEL_FILE), b"weights")?;
        write_until_full(&full)
    })
    .unwrap_err();
    let Error::NoSpace { path, needed, free } = &e else { panic!("{e:?}") };
    assert_eq!((path, *needed), (&full, 123_456_789));
    assert!(free.is_some());
    let said = e.to_string();
    assert!(said.contains("optimizer.safetensors: no space left"), "{said}");
    assert!(said.contains("needs 123456789 bytes (0.11 GiB)"), "{said}");
    assert!(!present(&dir), "the partial files hold on to space");
    // Other errors pass through unchanged, still cleaning up.
    fs::create_dir(&dir).unwrap();
    let e = writing(&dir, 1, || Err(Error::Invalid("bad".into()))).unwrap_err();
    assert!(matches!(e, Error::Invalid(_)) && !present(&dir));
}

#[test]
fn a_save_that_cannot_fit_stops_before_writing_anything() {
    let tmp = TempDir::new("nospace");
    assert!(free_bytes(&tmp.0).is_some_and(|b| b > 0));
    check_space(&tmp.0, 1).unwrap();
    let e = check_space(&tmp.0, u64::MAX).unwrap_err();
    assert!(matches!(e, Error::NoSpace { free: Some(_), .. }), "{e:?}");
    assert!(e.to_string().contains("GiB) and "), "{e}");
}

#[test]
fn the_space_a_save_checks_for_covers_what_it_writes() {
    let tmp = TempDir::new("bytes");
    let run = Run::new(2);
    let dir = run.save(&tmp.0, 1, &json!({"at": 1})).unwrap();
    let written: u64 =
        fs::read_dir(&dir).unwrap().map(|e| e.unwrap().metadata().unwrap().len()).sum();
    let ckpt = CheckpointRef {
        config: &run.config,
        weights: &run.weights,
        optimizer: &run.opt,
        state: &json!({"at": 1}),
        tokenizer_dir: None,
        extra: &[],
        draft: None,
    };
    let needed = checkpoint_bytes(&ckpt).unwrap();
    assert!(
        written <= needed && needed <= written + (1 << 20),
        "{written} written, {needed} asked"
    );
}
