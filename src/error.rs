//! Errors of every layer, and their one mapping onto NIXL status codes.
use std::fmt;

/// NIXL's `nixl_status_t` values, shared 1:1 by the C ABI (`nf_status`).
#[repr(C)]
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum nf_status {
    NF_IN_PROG = 1,
    NF_SUCCESS = 0,
    NF_ERR_NOT_POSTED = -1,
    NF_ERR_INVALID_PARAM = -2,
    NF_ERR_BACKEND = -3,
    NF_ERR_NOT_FOUND = -4,
    NF_ERR_MISMATCH = -5,
    NF_ERR_NOT_ALLOWED = -6,
    NF_ERR_REPOST_ACTIVE = -7,
    NF_ERR_UNKNOWN = -8,
    NF_ERR_NOT_SUPPORTED = -9,
    NF_ERR_REMOTE_DISCONNECT = -10,
    NF_ERR_CANCELED = -11,
}
pub use nf_status as Status;

impl Status {
    pub fn code(self) -> i32 {
        self as i32
    }
    pub fn from_code(c: i32) -> Status {
        use nf_status::*;
        match c {
            1 => NF_IN_PROG,
            0 => NF_SUCCESS,
            -1 => NF_ERR_NOT_POSTED,
            -2 => NF_ERR_INVALID_PARAM,
            -3 => NF_ERR_BACKEND,
            -4 => NF_ERR_NOT_FOUND,
            -5 => NF_ERR_MISMATCH,
            -6 => NF_ERR_NOT_ALLOWED,
            -7 => NF_ERR_REPOST_ACTIVE,
            -9 => NF_ERR_NOT_SUPPORTED,
            -10 => NF_ERR_REMOTE_DISCONNECT,
            -11 => NF_ERR_CANCELED,
            _ => NF_ERR_UNKNOWN,
        }
    }
    pub fn name(self) -> &'static str {
        use nf_status::*;
        match self {
            NF_IN_PROG => "NIXL_IN_PROG",
            NF_SUCCESS => "NIXL_SUCCESS",
            NF_ERR_NOT_POSTED => "NIXL_ERR_NOT_POSTED",
            NF_ERR_INVALID_PARAM => "NIXL_ERR_INVALID_PARAM",
            NF_ERR_BACKEND => "NIXL_ERR_BACKEND",
            NF_ERR_NOT_FOUND => "NIXL_ERR_NOT_FOUND",
            NF_ERR_MISMATCH => "NIXL_ERR_MISMATCH",
            NF_ERR_NOT_ALLOWED => "NIXL_ERR_NOT_ALLOWED",
            NF_ERR_REPOST_ACTIVE => "NIXL_ERR_REPOST_ACTIVE",
            NF_ERR_UNKNOWN => "NIXL_ERR_UNKNOWN",
            NF_ERR_NOT_SUPPORTED => "NIXL_ERR_NOT_SUPPORTED",
            NF_ERR_REMOTE_DISCONNECT => "NIXL_ERR_REMOTE_DISCONNECT",
            NF_ERR_CANCELED => "NIXL_ERR_CANCELED",
        }
    }
}

/// Everything that can go wrong, naming the operation that failed.
#[derive(Debug, Clone)]
pub enum Error {
    /// A libfabric call failed: `op` is the call, `code` its negative errno-style return.
    Fabric { op: &'static str, rail: Option<usize>, code: i32, detail: String },
    /// A completion reported an error for an operation of ours.
    Completion { op: &'static str, rail: usize, errno: i32, detail: String },
    /// The caller passed something unusable (bad pointer, length, key, value).
    InvalidParam(String),
    /// A remote blob (connection info, memory descriptor, control message) was malformed.
    Malformed { what: &'static str, why: String },
    /// A remote blob came from an incompatible format version.
    Version { what: &'static str, ours: u16, theirs: u16 },
    /// Two descriptions of the same thing disagree (e.g. the agent's and the blob's).
    Mismatch(String),
    /// A peer, registration or request that the call names is not known.
    NotFound(String),
    /// The peer stopped answering or went away.
    Disconnected(String),
    /// A bounded wait ran out.
    Timeout(String),
    /// The request was cancelled by its owner.
    Canceled,
    /// The capability is absent on this host or provider (e.g. VRAM without CUDA).
    NotSupported(String),
    /// The operation is not allowed in the current state.
    NotAllowed(String),
    /// The request is still running and cannot be reposted or released yet.
    RepostActive,
    /// A local resource or invariant failed (CUDA, allocation, internal).
    Backend(String),
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// The one place where errors become NIXL status codes.
    pub fn status(&self) -> Status {
        use nf_status::*;
        match self {
            // Posting to a peer whose address the provider no longer resolves (sockets says
            // ENOENT) is a disconnected peer, not a local fault.
            Error::Fabric { op, code, .. } if -code == libc::ENOENT && is_data_op(op) => NF_ERR_REMOTE_DISCONNECT,
            Error::Fabric { code, .. } => errno_status(-code),
            Error::Completion { errno, .. } => errno_status(*errno),
            Error::InvalidParam(_) => NF_ERR_INVALID_PARAM,
            Error::Malformed { .. } => NF_ERR_INVALID_PARAM,
            Error::Version { .. } | Error::Mismatch(_) => NF_ERR_MISMATCH,
            Error::NotFound(_) => NF_ERR_NOT_FOUND,
            Error::Disconnected(_) | Error::Timeout(_) => NF_ERR_REMOTE_DISCONNECT,
            Error::Canceled => NF_ERR_CANCELED,
            Error::NotSupported(_) => NF_ERR_NOT_SUPPORTED,
            Error::NotAllowed(_) => NF_ERR_NOT_ALLOWED,
            Error::RepostActive => NF_ERR_REPOST_ACTIVE,
            Error::Backend(_) => NF_ERR_BACKEND,
        }
    }
}

fn is_data_op(op: &str) -> bool {
    matches!(op, "fi_writemsg" | "fi_readmsg" | "fi_send")
}

/// Errno values that mean the peer is gone become REMOTE_DISCONNECT; the rest are backend
/// errors of the provider.
fn errno_status(errno: i32) -> Status {
    match errno {
        libc::ECONNREFUSED | libc::ECONNRESET | libc::ECONNABORTED | libc::EPIPE
        | libc::ENOTCONN | libc::EHOSTUNREACH | libc::ENETUNREACH | libc::ETIMEDOUT
        | libc::EHOSTDOWN | libc::ESHUTDOWN => Status::NF_ERR_REMOTE_DISCONNECT,
        libc::ECANCELED => Status::NF_ERR_CANCELED,
        libc::EINVAL => Status::NF_ERR_INVALID_PARAM,
        libc::ENOSYS | libc::EOPNOTSUPP => Status::NF_ERR_NOT_SUPPORTED,
        _ => Status::NF_ERR_BACKEND,
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Fabric { op, rail, code, detail } => match rail {
                Some(r) => write!(f, "{op} failed on rail {r}: {detail} ({code})"),
                None => write!(f, "{op} failed: {detail} ({code})"),
            },
            Error::Completion { op, rail, errno, detail } => {
                write!(f, "{op} completed with error on rail {rail}: {detail} (errno {errno})")
            }
            Error::InvalidParam(s) => write!(f, "invalid parameter: {s}"),
            Error::Malformed { what, why } => write!(f, "malformed {what}: {why}"),
            Error::Version { what, ours, theirs } => write!(
                f,
                "{what} has format version {theirs}, this build speaks version {ours}"
            ),
            Error::Mismatch(s) => write!(f, "mismatch: {s}"),
            Error::NotFound(s) => write!(f, "not found: {s}"),
            Error::Disconnected(s) => write!(f, "peer disconnected: {s}"),
            Error::Timeout(s) => write!(f, "timed out: {s}"),
            Error::Canceled => write!(f, "canceled"),
            Error::NotSupported(s) => write!(f, "not supported: {s}"),
            Error::NotAllowed(s) => write!(f, "not allowed: {s}"),
            Error::RepostActive => write!(f, "request still in progress"),
            Error::Backend(s) => write!(f, "backend error: {s}"),
        }
    }
}

impl std::error::Error for Error {}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn codes_round_trip() {
        for c in -11..=1 {
            if c == -8 {
                continue;
            }
            assert_eq!(Status::from_code(c).code(), c);
        }
        assert_eq!(Status::from_code(42), Status::NF_ERR_UNKNOWN);
    }
    #[test]
    fn dead_peer_errnos_map_to_disconnect() {
        let e = Error::Completion { op: "fi_writemsg", rail: 0, errno: libc::ECONNRESET, detail: String::new() };
        assert_eq!(e.status(), Status::NF_ERR_REMOTE_DISCONNECT);
        let e = Error::Fabric { op: "fi_av_insert", rail: None, code: -libc::EINVAL, detail: String::new() };
        assert_eq!(e.status(), Status::NF_ERR_INVALID_PARAM);
        let e = Error::Fabric { op: "fi_writemsg", rail: Some(0), code: -libc::ENOENT, detail: String::new() };
        assert_eq!(e.status(), Status::NF_ERR_REMOTE_DISCONNECT);
    }
}
