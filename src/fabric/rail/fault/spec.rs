//! The `fault_inject` spec: comma-separated `key=value` pairs, e.g.
//! `eagain=0.3,eagain_burst=8,reorder=1,delay=4,cq_error=0.001,seed=7`. Empty (or `off`)
//! turns the layer off. Probabilities are in 0..=1; unknown keys and malformed values are
//! refused, so a typo in a test run does not silently test nothing.
use crate::error::{Error, Result};

/// What to inject on each rail (see the README's "Fault injection" section).
#[derive(Clone, Debug, PartialEq)]
pub struct FaultSpec {
    /// A post (write, read, batch, send, recv, queued RMA) is not made and answers FI_EAGAIN.
    pub eagain: f64,
    /// After an injected FI_EAGAIN, this many further posts on the rail answer it too.
    pub eagain_burst: u32,
    /// An RMA post or a send fails as the provider would fail it (FI_EIO).
    pub post_fail: f64,
    /// A receive post fails (control receives: off unless asked for).
    pub post_fail_recv: f64,
    /// A successful RMA or send completion is reported as an error completion.
    pub cq_error: f64,
    /// The same for receive completions (the pre-posted control receives).
    pub cq_error_recv: f64,
    /// A completion of an RMA operation or send read from the CQ is held back and released
    /// later, out of order.
    pub reorder: f64,
    /// The same for receive completions: off unless asked for, since the engine asks
    /// providers for send-after-send order (FI_ORDER_SAS) and its control messages rely on
    /// it (a notification sent after another is delivered after it).
    pub reorder_recv: f64,
    /// A held completion waits 1..=delay further CQ polls on its rail.
    pub delay: u32,
    /// Most completions held at once per rail; beyond it completions pass through.
    pub hold: usize,
    pub seed: u64,
}

impl Default for FaultSpec {
    fn default() -> Self {
        FaultSpec {
            eagain: 0.0,
            eagain_burst: 0,
            post_fail: 0.0,
            post_fail_recv: 0.0,
            cq_error: 0.0,
            cq_error_recv: 0.0,
            reorder: 0.0,
            reorder_recv: 0.0,
            delay: 4,
            hold: 16,
            seed: 1,
        }
    }
}

fn bad(spec: &str, why: String) -> Error {
    Error::InvalidParam(format!("fault_inject '{spec}': {why}"))
}

fn prob(spec: &str, key: &str, v: &str) -> Result<f64> {
    match v.parse::<f64>() {
        Ok(p) if (0.0..=1.0).contains(&p) => Ok(p),
        _ => Err(bad(spec, format!("{key}={v} is not a probability in 0..1"))),
    }
}

fn count<T: std::str::FromStr>(spec: &str, key: &str, v: &str) -> Result<T> {
    v.parse().map_err(|_| bad(spec, format!("{key}={v} is not a whole number")))
}

impl FaultSpec {
    /// `None` for an empty or `off` spec.
    pub fn parse(spec: &str) -> Result<Option<FaultSpec>> {
        let s = spec.trim();
        if s.is_empty() || s.eq_ignore_ascii_case("off") {
            return Ok(None);
        }
        let mut f = FaultSpec::default();
        for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (k, v) = item.split_once('=').ok_or_else(|| bad(spec, format!("'{item}' is not key=value")))?;
            let (k, v) = (k.trim(), v.trim());
            match k {
                "eagain" => f.eagain = prob(spec, k, v)?,
                "eagain_burst" => f.eagain_burst = count(spec, k, v)?,
                "post_fail" => f.post_fail = prob(spec, k, v)?,
                "post_fail_recv" => f.post_fail_recv = prob(spec, k, v)?,
                "cq_error" => f.cq_error = prob(spec, k, v)?,
                "cq_error_recv" => f.cq_error_recv = prob(spec, k, v)?,
                "reorder" => f.reorder = prob(spec, k, v)?,
                "reorder_recv" => f.reorder_recv = prob(spec, k, v)?,
                "delay" => f.delay = count(spec, k, v)?,
                "hold" => f.hold = count(spec, k, v)?,
                "seed" => f.seed = count(spec, k, v)?,
                _ => return Err(bad(spec, format!("unknown key '{k}'"))),
            }
        }
        if f.delay == 0 {
            return Err(bad(spec, "delay must be at least 1 poll".into()));
        }
        Ok(Some(f))
    }
}

#[cfg(test)]
mod tests {
    use super::FaultSpec;

    #[test]
    fn parses_the_documented_example_and_refuses_typos() {
        let f = FaultSpec::parse("eagain=0.3, eagain_burst=8,reorder=1,delay=2,post_fail=0.001,cq_error=0.001,seed=7").unwrap().unwrap();
        assert_eq!(f.eagain, 0.3);
        assert_eq!(f.eagain_burst, 8);
        assert_eq!(f.reorder, 1.0);
        assert_eq!(f.delay, 2);
        assert_eq!(f.post_fail, 0.001);
        assert_eq!(f.cq_error, 0.001);
        assert_eq!(f.seed, 7);
        assert_eq!(f.cq_error_recv, 0.0);
        assert_eq!(FaultSpec::parse("").unwrap(), None);
        assert_eq!(FaultSpec::parse(" off ").unwrap(), None);
        for bad in ["eagian=0.1", "eagain=1.5", "eagain", "delay=0", "seed=-1", "reorder=x"] {
            assert!(FaultSpec::parse(bad).is_err(), "{bad}");
        }
    }
}
