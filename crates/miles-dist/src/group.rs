//! The processes of a run joined over TCP: rank 0 listens, the others connect to it (a star),
//! and the collectives go through rank 0 in rank order, so their results are the same bits on
//! every run. Every read and write is bounded by the group's timeout: a worker that died or
//! hangs turns into an error naming it on the ranks that wait for it.

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use crate::{Error, Result, World};

/// A run's processes, joined.
pub struct Group {
    rank: usize,
    world_size: usize,
    /// Rank 0: one stream per other rank, in rank order. Others: the stream to rank 0.
    links: Vec<TcpStream>,
    timeout: Duration,
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
    let what = what.into();
    move |source| Error::Io { what, source }
}

impl Group {
    /// The rendezvous: rank 0 listens on `MASTER_PORT` (all interfaces) until every other
    /// rank has connected and said who it is; the others connect to `MASTER_ADDR`, retrying
    /// until `timeout`.
    pub fn join(world: &World, timeout: Duration) -> Result<Group> {
        let deadline = Instant::now() + timeout;
        let mut links = Vec::new();
        if world.world_size > 1 && world.rank == 0 {
            let addr = ("0.0.0.0", world.master_port);
            let listener = TcpListener::bind(addr)
                .map_err(io(format!("rendezvous: listen on port {}", world.master_port)))?;
            listener.set_nonblocking(true).map_err(io("rendezvous"))?;
            let mut peers: Vec<Option<TcpStream>> = (0..world.world_size).map(|_| None).collect();
            while peers[1..].iter().any(Option::is_none) {
                match listener.accept() {
                    Ok((stream, _)) => {
                        stream.set_nonblocking(false).map_err(io("rendezvous"))?;
                        configure(&stream, timeout)?;
                        let mut stream = stream;
                        let hello = read_frame(&mut stream, "a connecting rank", timeout)?;
                        let (rank, size) = parse_hello(&hello)?;
                        if size != world.world_size || rank == 0 || rank >= size {
                            return Err(Error::Peer(format!(
                                "rendezvous: a process says it is rank {rank} of {size}, this run \
                                 has {} processes",
                                world.world_size
                            )));
                        }
                        if peers[rank].replace(stream).is_some() {
                            return Err(Error::Peer(format!(
                                "rendezvous: rank {rank} joined twice"
                            )));
                        }
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {
                        if Instant::now() > deadline {
                            let missing: Vec<usize> =
                                (1..world.world_size).filter(|&r| peers[r].is_none()).collect();
                            return Err(Error::Peer(format!(
                                "rendezvous: ranks {missing:?} did not connect to port {} within \
                                 {timeout:?}",
                                world.master_port
                            )));
                        }
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    Err(e) => return Err(io("rendezvous: accept")(e)),
                }
            }
            links = peers.into_iter().skip(1).map(|p| p.expect("all joined")).collect();
        } else if world.world_size > 1 {
            let target = format!("{}:{}", world.master_addr, world.master_port);
            let mut stream = loop {
                match TcpStream::connect(&target) {
                    Ok(s) => break s,
                    Err(e) if Instant::now() > deadline => {
                        return Err(Error::Peer(format!(
                            "rendezvous: rank {} could not reach rank 0 at {target} within \
                             {timeout:?}: {e}",
                            world.rank
                        )));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(50)),
                }
            };
            configure(&stream, timeout)?;
            let hello = [world.rank as u64, world.world_size as u64];
            let bytes: Vec<u8> = hello.iter().flat_map(|v| v.to_le_bytes()).collect();
            write_frame(&mut stream, &bytes, "rank 0")?;
            links.push(stream);
        }
        Ok(Group { rank: world.rank, world_size: world.world_size, links, timeout })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Rank 0's `data` on every rank.
    pub fn broadcast(&mut self, data: &mut Vec<u8>) -> Result<()> {
        if self.rank == 0 {
            for (i, link) in self.links.iter_mut().enumerate() {
                write_frame(link, data, &format!("rank {}", i + 1))?;
            }
        } else if let Some(link) = self.links.first_mut() {
            *data = read_frame(link, "rank 0", self.timeout)?;
        }
        Ok(())
    }

    /// Every rank's `mine` on rank 0, in rank order (`None` on the others).
    pub fn gather(&mut self, mine: &[u8]) -> Result<Option<Vec<Vec<u8>>>> {
        if self.rank != 0 {
            if let Some(link) = self.links.first_mut() {
                write_frame(link, mine, "rank 0")?;
            }
            return Ok(None);
        }
        let mut all = vec![mine.to_vec()];
        for (i, link) in self.links.iter_mut().enumerate() {
            all.push(read_frame(link, &format!("rank {}", i + 1), self.timeout)?);
        }
        Ok(Some(all))
    }

    /// Elementwise sums of every rank's `values` into each rank's, added in f32 in rank order
    /// (((r0 + r1) + r2) + …): the same bits on every run of the same processes.
    pub fn all_reduce_sum(&mut self, values: &mut [f32]) -> Result<()> {
        self.reduce(values)
    }

    /// [`Group::all_reduce_sum`] in f64 (metrics and counts).
    pub fn all_reduce_sum_f64(&mut self, values: &mut [f64]) -> Result<()> {
        self.reduce(values)
    }

    /// Waits until every rank has arrived.
    pub fn barrier(&mut self) -> Result<()> {
        self.reduce::<f32>(&mut [])
    }

    /// Rank 0 adds every rank's `values` to its own in rank order and sends the sums back. The
    /// ranks first agree on the length (a round trip, which is also the barrier); then the
    /// values go in chunks of [`CHUNK_BYTES`] through one reused buffer, so no rank copies a
    /// whole gradient into fresh memory and rank 0 adds each chunk while it is in cache.
    fn reduce<T: Num>(&mut self, values: &mut [T]) -> Result<()> {
        if self.world_size == 1 {
            return Ok(());
        }
        let timeout = self.timeout;
        // What the ranks agree on first: the number of values and their width.
        let shape = [values.len() as u64, T::BYTES as u64];
        let header: Vec<u8> = shape.iter().flat_map(|x| x.to_le_bytes()).collect();
        let mut buf = Vec::new();
        if self.rank != 0 {
            let link = &mut self.links[0];
            write_frame(link, &header, "rank 0")?;
            read_frame_into(link, &mut buf, "rank 0", timeout)?;
            for chunk in values.chunks_mut(CHUNK_BYTES / T::BYTES) {
                encode(chunk, &mut buf);
                write_frame(link, &buf, "rank 0")?;
                read_frame_into(link, &mut buf, "rank 0", timeout)?;
                if buf.len() != chunk.len() * T::BYTES {
                    return Err(Error::Peer("rank 0 sent a sum of another size".into()));
                }
                for (v, b) in chunk.iter_mut().zip(buf.chunks_exact(T::BYTES)) {
                    *v = T::get(b);
                }
            }
            return Ok(());
        }
        for (i, link) in self.links.iter_mut().enumerate() {
            read_frame_into(link, &mut buf, &format!("rank {}", i + 1), timeout)?;
            if buf != header {
                let theirs = if buf.len() == 16 {
                    let n = u64::from_le_bytes(buf[..8].try_into().expect("8 bytes"));
                    let w = u64::from_le_bytes(buf[8..].try_into().expect("8 bytes"));
                    format!("{n} values of {w} bytes")
                } else {
                    format!("a header of {} bytes", buf.len())
                };
                return Err(Error::Peer(format!(
                    "rank {} came to a reduction of {theirs} with {} values of {} bytes here: the \
                     ranks disagree on what they sum",
                    i + 1,
                    values.len(),
                    T::BYTES
                )));
            }
        }
        for (i, link) in self.links.iter_mut().enumerate() {
            write_frame(link, &header, &format!("rank {}", i + 1))?;
        }
        for chunk in values.chunks_mut(CHUNK_BYTES / T::BYTES) {
            for (i, link) in self.links.iter_mut().enumerate() {
                read_frame_into(link, &mut buf, &format!("rank {}", i + 1), timeout)?;
                if buf.len() != chunk.len() * T::BYTES {
                    return Err(Error::Peer(format!(
                        "rank {} sent a chunk of another size",
                        i + 1
                    )));
                }
                for (v, b) in chunk.iter_mut().zip(buf.chunks_exact(T::BYTES)) {
                    *v = *v + T::get(b);
                }
            }
            encode(chunk, &mut buf);
            for (i, link) in self.links.iter_mut().enumerate() {
                write_frame(link, &buf, &format!("rank {}", i + 1))?;
            }
        }
        Ok(())
    }
}

/// The bytes of a reduction's chunk: 1 MiB stays in cache and makes a round trip a small
/// part of its time.
const CHUNK_BYTES: usize = 1 << 20;

/// A number the group sums, sent as its little-endian bytes.
trait Num: Copy + std::ops::Add<Output = Self> {
    const BYTES: usize;
    fn put(self, out: &mut [u8]);
    fn get(bytes: &[u8]) -> Self;
}

macro_rules! num {
    ($t:ty, $bytes:literal) => {
        impl Num for $t {
            const BYTES: usize = $bytes;
            fn put(self, out: &mut [u8]) {
                out.copy_from_slice(&self.to_le_bytes());
            }
            fn get(bytes: &[u8]) -> Self {
                <$t>::from_le_bytes(bytes.try_into().expect("BYTES bytes"))
            }
        }
    };
}

num!(f32, 4);
num!(f64, 8);

fn encode<T: Num>(values: &[T], buf: &mut Vec<u8>) {
    buf.resize(values.len() * T::BYTES, 0);
    for (b, v) in buf.chunks_exact_mut(T::BYTES).zip(values) {
        v.put(b);
    }
}

fn configure(stream: &TcpStream, timeout: Duration) -> Result<()> {
    stream.set_nodelay(true).map_err(io("socket"))?;
    stream.set_read_timeout(Some(timeout)).map_err(io("socket"))?;
    stream.set_write_timeout(Some(timeout)).map_err(io("socket"))?;
    Ok(())
}

fn parse_hello(b: &[u8]) -> Result<(usize, usize)> {
    if b.len() != 16 {
        return Err(Error::Peer("rendezvous: a connection that is not a miles worker".into()));
    }
    let word = |i: usize| u64::from_le_bytes(b[i * 8..(i + 1) * 8].try_into().expect("8 bytes"));
    Ok((word(0) as usize, word(1) as usize))
}

fn peer_error(peer: &str, timeout: Duration, e: std::io::Error) -> Error {
    match e.kind() {
        ErrorKind::WouldBlock | ErrorKind::TimedOut => {
            Error::Peer(format!("{peer} did not answer within {timeout:?} (is it still running?)"))
        }
        ErrorKind::UnexpectedEof | ErrorKind::ConnectionReset | ErrorKind::BrokenPipe => {
            Error::Peer(format!("{peer} closed its connection: the process exited or failed"))
        }
        _ => Error::Peer(format!("{peer}: {e}")),
    }
}

fn write_frame(stream: &mut TcpStream, data: &[u8], peer: &str) -> Result<()> {
    let timeout = stream.write_timeout().ok().flatten().unwrap_or_default();
    stream
        .write_all(&(data.len() as u64).to_le_bytes())
        .and_then(|()| stream.write_all(data))
        .map_err(|e| peer_error(peer, timeout, e))
}

fn read_frame(stream: &mut TcpStream, peer: &str, timeout: Duration) -> Result<Vec<u8>> {
    let mut data = Vec::new();
    read_frame_into(stream, &mut data, peer, timeout)?;
    Ok(data)
}

fn read_frame_into(
    stream: &mut TcpStream,
    data: &mut Vec<u8>,
    peer: &str,
    timeout: Duration,
) -> Result<()> {
    let mut len = [0u8; 8];
    stream.read_exact(&mut len).map_err(|e| peer_error(peer, timeout, e))?;
    data.resize(u64::from_le_bytes(len) as usize, 0);
    stream.read_exact(data).map_err(|e| peer_error(peer, timeout, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn world(rank: usize, size: usize, port: u16) -> World {
        World {
            rank,
            world_size: size,
            local_rank: rank,
            master_addr: "127.0.0.1".into(),
            master_port: port,
        }
    }

    /// A port nothing listens on right now.
    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
    }

    /// Runs `f` on every rank of a `size`-process group (threads), returning their results.
    fn on_ranks<T: Send + 'static>(
        size: usize,
        f: impl Fn(Group) -> T + Send + Sync + Clone + 'static,
    ) -> Vec<T> {
        let port = free_port();
        let handles: Vec<_> = (0..size)
            .map(|r| {
                let f = f.clone();
                std::thread::spawn(move || {
                    f(Group::join(&world(r, size, port), Duration::from_secs(10)).unwrap())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn all_reduce_sums_in_rank_order_and_broadcast_reaches_everyone() {
        let results = on_ranks(4, |mut g| {
            let r = g.rank() as f32;
            let mut v = vec![0.1 * (r + 1.0), 1e8, -1e8 + r, r];
            g.all_reduce_sum(&mut v).unwrap();
            let mut msg = if g.rank() == 0 { b"unique id".to_vec() } else { Vec::new() };
            g.broadcast(&mut msg).unwrap();
            let gathered = g.gather(&[g.rank() as u8; 3][..g.rank()]).unwrap();
            assert_eq!(gathered.is_some(), g.rank() == 0);
            if let Some(all) = gathered {
                assert_eq!(all, [vec![], vec![1], vec![2, 2], vec![3, 3, 3]]);
            }
            let mut m = [g.rank() as f64, 1.0];
            g.all_reduce_sum_f64(&mut m).unwrap();
            g.barrier().unwrap();
            (v, msg, m)
        });
        // ((r0 + r1) + r2) + r3 in f32, as rank 0 adds them.
        let mut want = [0.1f32, 1e8, -1e8, 0.0];
        for r in 1..4 {
            let r = r as f32;
            for (w, x) in want.iter_mut().zip([0.1 * (r + 1.0), 1e8, -1e8 + r, r]) {
                *w += x;
            }
        }
        for (v, msg, m) in &results {
            assert_eq!(
                v.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
            );
            assert_eq!(msg, b"unique id");
            assert_eq!(m, &[6.0, 4.0]);
        }
    }

    /// Sums longer than a chunk (and not a whole number of them) keep rank order in every
    /// chunk; ranks that disagree on a sum's length all get an error, not a desynchronized run.
    #[test]
    fn long_sums_go_in_chunks_and_mismatched_lengths_are_errors() {
        let n = CHUNK_BYTES / 4 * 2 + 37;
        let value = |r: usize, i: usize| ((i * 7 + r * 13) % 1000) as f32 * 0.001 + r as f32 * 1e-7;
        let results = on_ranks(3, move |mut g| {
            let r = g.rank();
            let mut v: Vec<f32> = (0..n).map(|i| value(r, i)).collect();
            g.all_reduce_sum(&mut v).unwrap();
            let mut uneven = vec![1.0f32; 10 + r];
            let err = g.all_reduce_sum(&mut uneven).unwrap_err().to_string();
            (v, err)
        });
        let want: Vec<u32> =
            (0..n).map(|i| ((value(0, i) + value(1, i)) + value(2, i)).to_bits()).collect();
        for (v, _) in &results {
            assert!(v.iter().map(|x| x.to_bits()).eq(want.iter().copied()));
        }
        let e = &results[0].1;
        assert!(
            e.contains("rank 1 came to a reduction of 11 values of 4 bytes with 10 values"),
            "{e}"
        );
        assert!(results[1].1.contains("closed its connection"), "{}", results[1].1);
    }

    #[test]
    fn a_missing_or_dead_rank_is_an_error_not_a_hang() {
        let port = free_port();
        // Rank 1 of 3 never comes: rank 0 names it after the timeout.
        let two =
            std::thread::spawn(move || Group::join(&world(2, 3, port), Duration::from_secs(5)));
        let err = Group::join(&world(0, 3, port), Duration::from_millis(700)).err().unwrap();
        assert!(err.to_string().contains("ranks [1] did not connect"), "{err}");
        drop(two.join());

        // Rank 1 joins, then exits in the middle of a reduction: rank 0 says so.
        let port = free_port();
        let one = std::thread::spawn(move || {
            let g = Group::join(&world(1, 2, port), Duration::from_secs(5)).unwrap();
            drop(g);
        });
        let mut g = Group::join(&world(0, 2, port), Duration::from_secs(5)).unwrap();
        one.join().unwrap();
        let err = g.all_reduce_sum(&mut [1.0]).unwrap_err();
        assert!(err.to_string().contains("rank 1 closed its connection"), "{err}");

        // Rank 0 never answers: rank 1's reduction times out, naming it.
        let port = free_port();
        let zero = std::thread::spawn(move || {
            let g = Group::join(&world(0, 2, port), Duration::from_secs(5)).unwrap();
            std::thread::sleep(Duration::from_millis(1500));
            drop(g);
        });
        let mut g = Group::join(&world(1, 2, port), Duration::from_secs(5)).unwrap();
        g.timeout = Duration::from_millis(300);
        g.links[0].set_read_timeout(Some(g.timeout)).unwrap();
        let err = g.all_reduce_sum(&mut [1.0]).unwrap_err();
        assert!(err.to_string().contains("rank 0 did not answer within"), "{err}");
        zero.join().unwrap();
    }
}
