//! Ownership of KV cache blocks: a free list and a reference count per block. A prompt's full
//! blocks are shared by the samples of its group (one reference each); a block is written only
//! while exactly one sequence holds it.

use miles_model::BlockId;

pub struct BlockAllocator {
    refs: Vec<u32>,
    free: Vec<BlockId>,
    peak_used: usize,
}

impl BlockAllocator {
    pub fn new(num_blocks: usize) -> Self {
        // Lowest ids first: pop() takes from the end.
        let free = (0..num_blocks as BlockId).rev().collect();
        BlockAllocator { refs: vec![0; num_blocks], free, peak_used: 0 }
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    pub fn num_used(&self) -> usize {
        self.refs.len() - self.free.len()
    }

    /// Most blocks in use at once so far.
    pub fn peak_used(&self) -> usize {
        self.peak_used
    }

    pub fn allocate(&mut self) -> Option<BlockId> {
        let b = self.free.pop()?;
        self.refs[b as usize] = 1;
        self.peak_used = self.peak_used.max(self.num_used());
        Some(b)
    }

    /// One more holder of `block` (prefix sharing).
    pub fn share(&mut self, block: BlockId) {
        debug_assert!(self.refs[block as usize] > 0, "sharing a free block");
        self.refs[block as usize] += 1;
    }

    /// Drops one holder of each block; blocks nobody holds go back to the free list.
    pub fn release(&mut self, blocks: &[BlockId]) {
        for &b in blocks {
            let r = &mut self.refs[b as usize];
            debug_assert!(*r > 0, "releasing a free block");
            *r -= 1;
            if *r == 0 {
                self.free.push(b);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_blocks_return_when_the_last_holder_releases() {
        let mut a = BlockAllocator::new(3);
        let (x, y) = (a.allocate().unwrap(), a.allocate().unwrap());
        assert_eq!((x, y, a.num_free()), (0, 1, 1));
        a.share(x);
        assert_eq!((a.refs[x as usize], a.refs[y as usize]), (2, 1));
        a.release(&[x, y]);
        assert_eq!(a.num_free(), 2);
        a.release(&[x]);
        assert_eq!((a.num_free(), a.peak_used()), (3, 2));
        let _ = (a.allocate(), a.allocate(), a.allocate());
        assert!(a.allocate().is_none());
    }
}
