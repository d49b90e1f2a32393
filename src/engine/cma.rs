//! Cross-memory attach (CMA) between processes of one host: whether the kernel lets this
//! process read another's memory directly (process_vm_readv). libfabric's shm provider
//! makes the same check with the same system call family before it copies data itself, so
//! our answer tells whether shm RMA to that peer completes only once delivered.
use super::wire::ProcessInfo;

/// A random token at a stable address, published in our connection info so that a peer
/// can read it back and so prove that the pid it was given is really ours and reachable.
pub struct Token(Box<[u8; 16]>);

impl Token {
    pub fn new(seed: [u64; 2]) -> Token {
        let mut t = [0u8; 16];
        t[..8].copy_from_slice(&seed[0].to_le_bytes());
        t[8..].copy_from_slice(&seed[1].to_le_bytes());
        Token(Box::new(t))
    }

    /// Our process and where the token lies (a heap address: it does not move while the
    /// engine holds the token).
    pub fn info(&self) -> ProcessInfo {
        ProcessInfo { pid: std::process::id(), token_addr: self.0.as_ptr() as u64, token: *self.0 }
    }
}

/// Whether `peer` can be read with process_vm_readv: the token at its address matches.
/// Fails (false) where ptrace rules (Yama ptrace_scope, other users), pid namespaces or a
/// stale pid get in the way.
pub fn reachable(peer: &ProcessInfo) -> bool {
    let mut got = [0u8; 16];
    let local = libc::iovec { iov_base: got.as_mut_ptr() as *mut libc::c_void, iov_len: got.len() };
    let remote = libc::iovec { iov_base: peer.token_addr as *mut libc::c_void, iov_len: got.len() };
    // SAFETY: `local` describes our own 16-byte buffer; the kernel checks the remote range
    // against the target's mappings and permissions and fails the call (it never touches
    // our memory outside `local`).
    let n = unsafe { libc::process_vm_readv(peer.pid as libc::pid_t, &local, 1, &remote, 1, 0) };
    n == got.len() as isize && got == peer.token
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_token_is_reachable_and_a_wrong_token_is_not() {
        let t = Token::new([1, 2]);
        let mut info = t.info();
        assert!(reachable(&info));
        info.token[0] ^= 1;
        assert!(!reachable(&info));
        info = t.info();
        info.token_addr = 8; // unmapped
        assert!(!reachable(&info));
    }
}
