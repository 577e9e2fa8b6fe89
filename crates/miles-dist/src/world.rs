//! Which process of a run this is, from the launcher's environment.

use crate::{Error, Result};

/// One process's place in a run of `world_size` processes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct World {
    pub rank: usize,
    pub world_size: usize,
    /// The GPU of this process on its host.
    pub local_rank: usize,
    /// Where rank 0 listens for the rendezvous.
    pub master_addr: String,
    pub master_port: u16,
}

impl World {
    /// torchrun's variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`;
    /// where torchrun's agent serves its store on `MASTER_PORT`, the rendezvous takes the next
    /// port), else Slurm's (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, with `MASTER_ADDR`
    /// and `MASTER_PORT` set by the job script); `None` when neither names a rank (one
    /// process, or a world of one).
    /// `get` reads a variable (`std::env::var(..).ok()` in the binary).
    pub fn from_env(get: impl Fn(&str) -> Option<String>) -> Result<Option<World>> {
        let (rank_var, size_var, local_var) = if get("RANK").is_some() {
            ("RANK", "WORLD_SIZE", "LOCAL_RANK")
        } else if get("SLURM_PROCID").is_some() {
            ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
        } else {
            return Ok(None);
        };
        let number = |var: &'static str, default: Option<usize>| -> Result<usize> {
            match (get(var), default) {
                (Some(v), _) => v.trim().parse().map_err(|_| Error::Env {
                    var,
                    message: format!("'{v}' is not a non-negative integer"),
                }),
                (None, Some(d)) => Ok(d),
                (None, None) => Err(Error::Env {
                    var,
                    message: format!("not set, but {rank_var} is: set both"),
                }),
            }
        };
        let rank = number(rank_var, None)?;
        let world_size = number(size_var, None)?;
        let local_rank = number(local_var, Some(rank))?;
        if rank >= world_size {
            return Err(Error::Env {
                var: rank_var,
                message: format!("{rank} is not below {size_var} {world_size}"),
            });
        }
        // A world of one (a single Slurm task, say) is one process: `--nproc-per-node` may
        // still start workers from it.
        if world_size == 1 {
            return Ok(None);
        }
        let master_addr = match get("MASTER_ADDR") {
            Some(a) if !a.trim().is_empty() => a.trim().to_string(),
            _ => {
                return Err(Error::Env {
                    var: "MASTER_ADDR",
                    message: "not set: the host where rank 0 runs".into(),
                });
            }
        };
        let master_port: u16 = match get("MASTER_PORT") {
            Some(p) => p.trim().parse().map_err(|_| Error::Env {
                var: "MASTER_PORT",
                message: format!("'{p}' is not a port number"),
            })?,
            None => {
                return Err(Error::Env {
                    var: "MASTER_PORT",
                    message: "not set: the port rank 0 listens on".into(),
                });
            }
        };
        // torchrun's agent (TORCHELASTIC_USE_AGENT_STORE=True, c10d rendezvous) already serves
        // its own store on MASTER_PORT: rank 0 listens on the next port.
        let master_port = if get("TORCHELASTIC_USE_AGENT_STORE").as_deref() == Some("True") {
            master_port.checked_add(1).ok_or_else(|| Error::Env {
                var: "MASTER_PORT",
                message: "65535 is torchrun's store; the rendezvous needs the next port".into(),
            })?
        } else {
            master_port
        };
        Ok(Some(World { rank, world_size, local_rank, master_addr, master_port }))
    }

    /// The variables that make a child process this rank (as torchrun sets them), plus
    /// `NCCL_NVLS_ENABLE=0`: NVLink multicast stays off for the workers.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("RANK", self.rank.to_string()),
            ("WORLD_SIZE", self.world_size.to_string()),
            ("LOCAL_RANK", self.local_rank.to_string()),
            ("LOCAL_WORLD_SIZE", self.world_size.to_string()),
            ("MASTER_ADDR", self.master_addr.clone()),
            ("MASTER_PORT", self.master_port.to_string()),
            ("NCCL_NVLS_ENABLE", "0".into()),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn from(vars: &[(&str, &str)]) -> Result<Option<World>> {
        let map: HashMap<String, String> =
            vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        World::from_env(|k| map.get(k).cloned())
    }

    #[test]
    fn reads_torchrun_and_slurm_and_names_what_is_wrong() {
        assert_eq!(from(&[]).unwrap(), None);
        let torchrun = [
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "29501"),
        ];
        let w = from(&torchrun).unwrap().unwrap();
        assert_eq!((w.rank, w.world_size, w.local_rank, w.master_port), (3, 8, 1, 29501));
        // Where torchrun's agent serves its store on MASTER_PORT, the rendezvous takes the next.
        let agent = [&torchrun[..], &[("TORCHELASTIC_USE_AGENT_STORE", "True")]].concat();
        assert_eq!(from(&agent).unwrap().unwrap().master_port, 29502);
        let last =
            [("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h"), ("MASTER_PORT", "65535")];
        let at_end = [&last[..], &[("TORCHELASTIC_USE_AGENT_STORE", "True")]].concat();
        assert!(from(&at_end).unwrap_err().to_string().contains("the next port"));
        // A single task is one process (its --nproc-per-node may start workers).
        assert_eq!(from(&[("RANK", "0"), ("WORLD_SIZE", "1")]).unwrap(), None);
        assert_eq!(from(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "1")]).unwrap(), None);
        let slurm = [
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "16"),
            ("SLURM_LOCALID", "5"),
            ("MASTER_ADDR", "n1"),
            ("MASTER_PORT", "1234"),
        ];
        let w = from(&slurm).unwrap().unwrap();
        assert_eq!((w.rank, w.world_size, w.local_rank, w.master_addr.as_str()), (5, 16, 5, "n1"));
        let err = |vars: &[(&str, &str)]| from(vars).unwrap_err().to_string();
        assert_eq!(err(&[("RANK", "0")]), "WORLD_SIZE: not set, but RANK is: set both");
        assert!(err(&[("RANK", "x"), ("WORLD_SIZE", "2")]).starts_with("RANK: 'x' is not"));
        assert!(err(&[("RANK", "2"), ("WORLD_SIZE", "2")]).contains("not below WORLD_SIZE 2"));
        assert!(err(&[("RANK", "0"), ("WORLD_SIZE", "2")]).starts_with("MASTER_ADDR: not set"));
        let no_port = [("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h")];
        assert!(err(&no_port).starts_with("MASTER_PORT: not set"));
        let env = from(&torchrun).unwrap().unwrap().env();
        assert!(env.contains(&("NCCL_NVLS_ENABLE", "0".to_string())));
        assert!(env.contains(&("RANK", "3".to_string())));
    }
}
