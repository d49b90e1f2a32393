//! A slab whose tokens carry a generation: an answer or completion for an entry that was
//! removed (its slot since reused) finds nothing instead of the new entry.

/// Slab with generation-tagged tokens, so an answer for a finished chunk is ignored.
pub struct Slab<T> {
    items: Vec<Option<T>>,
    gens: Vec<u32>,
    free: Vec<u32>,
}

impl<T> Default for Slab<T> {
    fn default() -> Self {
        Slab { items: Vec::new(), gens: Vec::new(), free: Vec::new() }
    }
}

impl<T> Slab<T> {
    pub fn insert(&mut self, v: T) -> u64 {
        let i = match self.free.pop() {
            Some(i) => i as usize,
            None => {
                self.items.push(None);
                self.gens.push(0);
                self.items.len() - 1
            }
        };
        self.items[i] = Some(v);
        (self.gens[i] as u64) << 32 | i as u64
    }
    pub fn get_mut(&mut self, token: u64) -> Option<&mut T> {
        let i = (token & 0xffff_ffff) as usize;
        if *self.gens.get(i)? != (token >> 32) as u32 {
            return None;
        }
        self.items[i].as_mut()
    }
    pub fn remove(&mut self, token: u64) -> Option<T> {
        self.get_mut(token)?;
        let i = (token & 0xffff_ffff) as usize;
        self.gens[i] = self.gens[i].wrapping_add(1);
        self.free.push(i as u32);
        self.items[i].take()
    }
    pub fn is_empty(&self) -> bool {
        self.free.len() == self.items.len()
    }
    pub fn tokens(&self) -> Vec<u64> {
        self.items.iter().enumerate().filter(|(_, v)| v.is_some()).map(|(i, _)| (self.gens[i] as u64) << 32 | i as u64).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::Slab;

    #[test]
    fn slab_tokens_of_removed_items_are_stale() {
        let mut s = Slab::default();
        let a = s.insert(1);
        let b = s.insert(2);
        assert_eq!(s.remove(a), Some(1));
        assert!(s.get_mut(a).is_none(), "stale token");
        let c = s.insert(3);
        assert_ne!(a, c, "slot reused under a new generation");
        assert_eq!(s.tokens().len(), 2);
        assert_eq!(s.remove(b), Some(2));
        assert_eq!(s.remove(c), Some(3));
        assert!(s.is_empty());
    }
}

