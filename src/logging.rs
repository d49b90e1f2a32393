//! Logging through the `log` crate to stderr. The level comes from NIXL_FABRIC_LOG (ours)
//! or else NIXL_LOG_LEVEL (the agent's); the default is WARN, so normal operation prints
//! nothing. Lines carry the agent name where the caller includes it.
use log::{Level, LevelFilter, Log, Metadata, Record};
use std::io::Write;
use std::sync::OnceLock;

struct StderrLogger;

impl Log for StderrLogger {
    fn enabled(&self, m: &Metadata) -> bool {
        m.level() <= log::max_level()
    }
    fn log(&self, r: &Record) {
        if !self.enabled(r.metadata()) {
            return;
        }
        let lvl = match r.level() {
            Level::Error => "E",
            Level::Warn => "W",
            Level::Info => "I",
            Level::Debug => "D",
            Level::Trace => "T",
        };
        // One write per line so lines from several threads do not interleave.
        let line = format!("[nixl-fabric {lvl} {}] {}\n", std::process::id(), r.args());
        let _ = std::io::stderr().write_all(line.as_bytes());
    }
    fn flush(&self) {}
}

fn parse_level(v: &str) -> Option<LevelFilter> {
    Some(match v.trim().to_ascii_uppercase().as_str() {
        "TRACE" => LevelFilter::Trace,
        "DEBUG" => LevelFilter::Debug,
        "INFO" => LevelFilter::Info,
        "WARN" | "WARNING" => LevelFilter::Warn,
        "ERROR" | "FATAL" => LevelFilter::Error,
        "OFF" | "NONE" => LevelFilter::Off,
        _ => return None,
    })
}

/// Installs the logger once per process; later calls do nothing. If the host process
/// already installed a `log` logger, that one is used.
pub fn init() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        let level = std::env::var("NIXL_FABRIC_LOG")
            .ok()
            .and_then(|v| parse_level(&v))
            .or_else(|| std::env::var("NIXL_LOG_LEVEL").ok().and_then(|v| parse_level(&v)))
            .unwrap_or(LevelFilter::Warn);
        if log::set_boxed_logger(Box::new(StderrLogger)).is_ok() {
            log::set_max_level(level);
        }
    });
}

#[cfg(test)]
mod tests {
    #[test]
    fn levels_parse() {
        assert_eq!(super::parse_level("debug"), Some(log::LevelFilter::Debug));
        assert_eq!(super::parse_level("FATAL"), Some(log::LevelFilter::Error));
        assert_eq!(super::parse_level("loud"), None);
    }
}
