//! `--nproc-per-node N`: one worker process per GPU of this host, as torchrun starts them.

use std::process::{Child, Command};
use std::time::Duration;

use crate::{Error, Result, World};

/// Runs `n` copies of `program args` as ranks 0..n of one run on this host (torchrun's
/// variables from [`World::env`], rank 0 listening on `port`, `LOCAL_RANK` naming each one's
/// GPU) and waits for them. When one fails, the others are stopped and the error names the
/// failed ones: a dead worker stops the run instead of leaving the rest waiting.
pub fn launch_local(n: usize, port: u16, program: &std::path::Path, args: &[String]) -> Result<()> {
    if n == 0 {
        return Err(Error::Peer("--nproc-per-node: at least 1".into()));
    }
    let mut children: Vec<Option<Child>> = Vec::with_capacity(n);
    for rank in 0..n {
        let world = World {
            rank,
            world_size: n,
            local_rank: rank,
            master_addr: "127.0.0.1".into(),
            master_port: port,
        };
        let mut cmd = Command::new(program);
        // (A torchrun agent's store, if this launcher runs under one, is not the workers'.)
        cmd.args(args).envs(world.env()).env_remove("TORCHELASTIC_USE_AGENT_STORE");
        match cmd.spawn() {
            Ok(c) => children.push(Some(c)),
            Err(e) => {
                stop(&mut children);
                return Err(Error::Io {
                    what: format!("start worker {rank} ({})", program.display()),
                    source: e,
                });
            }
        }
    }
    loop {
        let mut running = 0;
        let mut failed = Vec::new();
        for (rank, slot) in children.iter_mut().enumerate() {
            let Some(child) = slot.as_mut() else { continue };
            match child.try_wait() {
                Ok(None) => running += 1,
                Ok(Some(status)) if status.success() => *slot = None,
                Ok(Some(status)) => {
                    *slot = None;
                    failed.push(format!("{rank} ({status})"));
                }
                Err(e) => {
                    stop(&mut children);
                    return Err(Error::Io { what: format!("wait for worker {rank}"), source: e });
                }
            }
        }
        if !failed.is_empty() {
            // The others usually follow within moments (their peer is gone): name them too.
            std::thread::sleep(Duration::from_millis(200));
            for (rank, slot) in children.iter_mut().enumerate() {
                if let Some(Ok(Some(status))) = slot.as_mut().map(Child::try_wait)
                    && !status.success()
                {
                    *slot = None;
                    failed.push(format!("{rank} ({status})"));
                }
            }
            stop(&mut children);
            failed.sort();
            return Err(Error::Peer(format!(
                "worker {} of {n} failed; stopped the others",
                failed.join(", worker ")
            )));
        }
        if running == 0 {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn stop(children: &mut [Option<Child>]) {
    for child in children.iter_mut().flatten() {
        let _ = child.kill();
        let _ = child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    fn sh(script: &str) -> Vec<String> {
        vec!["-c".into(), script.into()]
    }

    #[test]
    fn workers_get_their_rank_and_a_failure_stops_the_rest() {
        let sh_path = std::path::Path::new("/bin/sh");
        // Every worker sees its place in the run.
        let check = "[ \"$WORLD_SIZE\" = 3 ] && [ \"$RANK\" = \"$LOCAL_RANK\" ] && \
                     [ \"$NCCL_NVLS_ENABLE\" = 0 ] && [ \"$MASTER_PORT\" = 29555 ]";
        launch_local(3, 29555, sh_path, &sh(check)).unwrap();
        // Rank 1 fails at once while rank 0 would run for a minute: the launcher returns
        // quickly, names rank 1, and rank 0 is gone.
        let started = Instant::now();
        let script = "if [ \"$RANK\" = 1 ]; then exit 3; else exec sleep 60; fi";
        let err = launch_local(2, 29556, sh_path, &sh(script)).unwrap_err().to_string();
        assert!(err.starts_with("worker 1 (exit status: 3) of 2 failed"), "{err}");
        assert!(started.elapsed() < Duration::from_secs(20), "{:?}", started.elapsed());
        let missing = launch_local(1, 29557, std::path::Path::new("/no/such/miles"), &[]);
        assert!(missing.unwrap_err().to_string().contains("start worker 0"));
    }
}
