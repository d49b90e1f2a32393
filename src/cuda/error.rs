//! The error of every call in `cuda/`, and its conversion into the crate's error.
use std::fmt;

/// What went wrong in the CUDA layer. Driver failures carry the driver function and its
/// `CUresult` (code and the name cuGetErrorName gives it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CudaError {
    /// The driver cannot be used on this host: `lib` did not load (the `reason` is the
    /// dlopen error text), lacks an essential entry point, or cuInit failed.
    Unavailable { lib: String, reason: String },
    /// The loaded driver lacks an optional entry point that this call needs.
    Missing { func: &'static str },
    /// A driver call returned an error.
    Driver { func: &'static str, code: i32, name: String },
    /// An argument was rejected before reaching the driver (length, offset, range).
    Invalid(String),
}

pub type Result<T> = std::result::Result<T, CudaError>;

impl CudaError {
    /// The `CUresult` of a failed driver call.
    pub fn code(&self) -> Option<i32> {
        match self {
            CudaError::Driver { code, .. } => Some(*code),
            _ => None,
        }
    }
    /// The driver function that failed or is missing.
    pub fn func(&self) -> Option<&'static str> {
        match self {
            CudaError::Driver { func, .. } | CudaError::Missing { func } => Some(func),
            _ => None,
        }
    }
}

impl fmt::Display for CudaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CudaError::Unavailable { lib, reason } => write!(f, "CUDA driver not available ({lib}): {reason}"),
            CudaError::Missing { func } => write!(f, "CUDA driver lacks {func}"),
            CudaError::Driver { func, code, name } => write!(f, "{func} failed: {name} ({code})"),
            CudaError::Invalid(s) => write!(f, "invalid CUDA request: {s}"),
        }
    }
}

impl std::error::Error for CudaError {}

/// No driver (or no entry point) means the capability is absent: NOT_SUPPORTED. A failed
/// driver call is a local backend failure. A rejected argument is the caller's.
impl From<CudaError> for crate::error::Error {
    fn from(e: CudaError) -> Self {
        use crate::error::Error;
        match e {
            CudaError::Unavailable { .. } | CudaError::Missing { .. } => Error::NotSupported(e.to_string()),
            CudaError::Driver { .. } => Error::Backend(e.to_string()),
            CudaError::Invalid(_) => Error::InvalidParam(e.to_string()),
        }
    }
}

/// Names of the codes we test for, used only when cuGetErrorName cannot answer.
pub(super) fn fallback_name(code: i32) -> String {
    use super::sys::*;
    let n = match code {
        CUDA_SUCCESS => "CUDA_SUCCESS",
        CUDA_ERROR_INVALID_VALUE => "CUDA_ERROR_INVALID_VALUE",
        CUDA_ERROR_OUT_OF_MEMORY => "CUDA_ERROR_OUT_OF_MEMORY",
        CUDA_ERROR_NOT_INITIALIZED => "CUDA_ERROR_NOT_INITIALIZED",
        CUDA_ERROR_DEINITIALIZED => "CUDA_ERROR_DEINITIALIZED",
        CUDA_ERROR_STUB_LIBRARY => "CUDA_ERROR_STUB_LIBRARY",
        CUDA_ERROR_NO_DEVICE => "CUDA_ERROR_NO_DEVICE",
        CUDA_ERROR_INVALID_DEVICE => "CUDA_ERROR_INVALID_DEVICE",
        CUDA_ERROR_INVALID_CONTEXT => "CUDA_ERROR_INVALID_CONTEXT",
        CUDA_ERROR_INVALID_HANDLE => "CUDA_ERROR_INVALID_HANDLE",
        CUDA_ERROR_NOT_FOUND => "CUDA_ERROR_NOT_FOUND",
        CUDA_ERROR_NOT_READY => "CUDA_ERROR_NOT_READY",
        CUDA_ERROR_ALREADY_MAPPED => "CUDA_ERROR_ALREADY_MAPPED",
        CUDA_ERROR_NOT_SUPPORTED => "CUDA_ERROR_NOT_SUPPORTED",
        CUDA_ERROR_ILLEGAL_ADDRESS => "CUDA_ERROR_ILLEGAL_ADDRESS",
        _ => return format!("unknown CUresult {code}"),
    };
    n.to_string()
}
