//! The fault layer's random numbers: xorshift64*, seeded per rail, so a run with a given
//! `seed` makes the same sequence of decisions on each rail (no crate for a few lines).

pub(crate) struct Rng(u64);

impl Rng {
    /// Rails share the spec's seed; mixing in the rail index gives each its own stream.
    pub(crate) fn new(seed: u64, rail: usize) -> Rng {
        // splitmix64 of the pair: seeds 0 and 1 still start far apart, and a zero state
        // (xorshift's one fixed point) cannot come out of it for any input in practice.
        let mut z = seed ^ (rail as u64).wrapping_add(1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        Rng(if z == 0 { 0x2545_f491_4f6c_dd1d } else { z })
    }

    pub(crate) fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// True with probability `p` (0 never draws, so an unused fault kind costs nothing and
    /// leaves the stream of the others unchanged).
    pub(crate) fn chance(&mut self, p: f64) -> bool {
        if p <= 0.0 {
            return false;
        }
        if p >= 1.0 {
            return true;
        }
        ((self.next() >> 11) as f64 / (1u64 << 53) as f64) < p
    }

    /// Uniform in 1..=n (n >= 1).
    pub(crate) fn between_1_and(&mut self, n: u32) -> u32 {
        1 + (self.next() % u64::from(n.max(1))) as u32
    }

    /// Fisher-Yates.
    pub(crate) fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = (self.next() % (i as u64 + 1)) as usize;
            v.swap(i, j);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Rng;

    #[test]
    fn same_seed_same_stream_other_rail_other_stream() {
        let (mut a, mut b, mut c) = (Rng::new(7, 1), Rng::new(7, 1), Rng::new(7, 2));
        let xa: Vec<u64> = (0..8).map(|_| a.next()).collect();
        let xb: Vec<u64> = (0..8).map(|_| b.next()).collect();
        let xc: Vec<u64> = (0..8).map(|_| c.next()).collect();
        assert_eq!(xa, xb);
        assert_ne!(xa, xc);
    }

    #[test]
    fn chance_follows_p() {
        let mut r = Rng::new(1, 0);
        let hits = (0..100_000).filter(|_| r.chance(0.3)).count();
        assert!((28_000..32_000).contains(&hits), "{hits}");
        assert!((0..100).all(|_| r.chance(1.0)) && !(0..100).any(|_| r.chance(0.0)));
        assert!((0..1000).map(|_| r.between_1_and(3)).all(|x| (1..=3).contains(&x)));
    }
}
