//! `miles bench allreduce`: the gradient sum's bandwidth between the ranks of a run, through
//! the collectives training uses (NCCL between GPUs, the TCP group between host processes),
//! checked before it is timed. `tests/device/nccl_allreduce_peer.py` measures NCCL's own
//! figure (PyTorch's `all_reduce` under torchrun) on the same sizes.

use std::io::Write;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use miles_dist::{Group, World};
use miles_tensor::{Collective, Device, Tensor};
use serde_json::json;

use crate::common::{launch, parse_device};

#[derive(Debug, Args)]
pub struct AllReduceBenchArgs {
    /// Where the buffers live: cuda (each rank on the GPU of its local rank, NCCL) or cpu
    /// (host buffers summed over the TCP group).
    #[arg(long, default_value = "cuda", value_parser = parse_device)]
    pub device: Device,
    /// Ranks on this host (one process each); or start the ranks with torchrun or Slurm.
    #[arg(long, default_value_t = 2)]
    pub nproc_per_node: usize,
    /// Buffer sizes in MiB, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,16,64,256")]
    pub sizes_mb: Vec<f64>,
    /// Timed sums per size (after two untimed ones).
    #[arg(long, default_value_t = 20)]
    pub iters: usize,
}

pub fn run(args: &AllReduceBenchArgs, out: &mut dyn Write) -> anyhow::Result<()> {
    if args.iters == 0 || args.sizes_mb.iter().any(|&s| s.is_nan() || s <= 0.0) {
        bail!("--iters must be >= 1 and every --sizes-mb positive");
    }
    let Some(world) = World::from_env(|k| std::env::var(k).ok())? else {
        if args.nproc_per_node < 2 {
            bail!("--nproc-per-node: a sum over the ranks needs at least 2");
        }
        return launch(args.nproc_per_node, "bench allreduce", out);
    };
    let timeout = Duration::from_secs(120);
    let mut group = Group::join(&world, timeout)
        .with_context(|| format!("rank {} of {}", world.rank, world.world_size))?;
    let device = match args.device {
        Device::Cpu => Device::Cpu,
        Device::Cuda(_) => Device::Cuda(world.local_rank),
    };
    let nccl = match device {
        Device::Cpu => None,
        Device::Cuda(_) => {
            let mut id = if world.rank == 0 { Collective::new_id()? } else { Vec::new() };
            group.broadcast(&mut id)?;
            let c = Collective::join(
                &device,
                &id,
                world.rank,
                world.world_size,
                Duration::from_secs(120),
            )
            .with_context(|| format!("rank {} joining NCCL on {device}", world.rank))?;
            Some(c)
        }
    };
    let n_ranks = world.world_size as f64;
    for &mb in &args.sizes_mb {
        let len = ((mb * (1 << 20) as f64) / 4.0).round().max(1.0) as usize;
        // Rank r holds (r + 1)·v: the sum is (N(N+1)/2)·v, exact for these small integers.
        let v: Vec<f32> = (0..len).map(|i| (i % 64) as f32).collect();
        let mine: Vec<f32> = v.iter().map(|x| x * (world.rank + 1) as f32).collect();
        let mut t = Tensor::from_f32(&[len], mine.clone(), &device)?;
        let mut host = mine.clone();
        let mut sum = |t: &mut Tensor, host: &mut Vec<f32>| -> anyhow::Result<()> {
            match &nccl {
                Some(c) => c.all_reduce_sum(&mut [t])?,
                None => group.all_reduce_sum(host)?,
            }
            Ok(())
        };
        sum(&mut t, &mut host)?;
        let got = if nccl.is_some() { t.to_vec_f32()? } else { host.clone() };
        let factor = (n_ranks * (n_ranks + 1.0) / 2.0) as f32;
        if let Some(i) = got.iter().zip(&v).position(|(g, x)| *g != x * factor) {
            bail!("all-reduce of {mb} MiB: element {i} is {}, not {}", got[i], v[i] * factor);
        }
        sum(&mut t, &mut host)?;
        device.synchronize()?;
        let started = Instant::now();
        for _ in 0..args.iters {
            sum(&mut t, &mut host)?;
        }
        device.synchronize()?;
        let seconds = started.elapsed().as_secs_f64() / args.iters as f64;
        if world.rank == 0 {
            let bytes = (4 * len) as f64;
            let algbw = bytes / seconds / 1e9;
            let line = json!({
                "what": "allreduce",
                "via": if nccl.is_some() { "nccl" } else { "tcp" },
                "device": device.to_string(),
                "ranks": world.world_size,
                "bytes": 4 * len,
                "seconds": seconds,
                "algbw_gb_s": algbw,
                // NCCL's bus bandwidth: what each link carries in a ring, 2(N−1)/N of the data.
                "busbw_gb_s": algbw * 2.0 * (n_ranks - 1.0) / n_ranks,
            });
            writeln!(out, "{line}")?;
        }
    }
    Ok(())
}
