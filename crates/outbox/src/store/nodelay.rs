//! `TCP_NODELAY` for the database connections.
//!
//! sqlx 0.9.0 no longer sets `TCP_NODELAY` on its sockets (it did from 0.7.4 to 0.8; the change
//! is launchbadge/sqlx#4022, reported as #4335 and fixed upstream by #4336, not released as of
//! sqlx 0.9.0). Without it, a message the client writes while an earlier one is not yet
//! acknowledged waits for the server's delayed ACK: Nagle's algorithm against delayed ACK, up to
//! 40 ms on Linux. On this project's bench machine that was the relay's latency tail: at 1,000
//! commits/s the commit → broker-ack maximum was 95–98 ms in every run and fell to 19–28 ms with
//! the kernel told to acknowledge at once (`ip route … quickack 1`), p99 from 9–31 ms to 5–8 ms
//! (docs/benchmarks.md).
//!
//! sqlx gives no access to its socket, so the stores' `connect` pools run
//! [`set_nodelay_towards`] after each new connection: it finds this process's TCP sockets
//! connected to the database server (by the peer address) and sets the option on them. Remove
//! this module when sqlx ships #4336.

use std::net::SocketAddr;

/// The socket addresses `host:port` resolves to (empty for a Unix-socket host, a path, or a
/// host that does not resolve: then nothing is changed).
pub async fn resolve(host: &str, port: u16) -> Vec<SocketAddr> {
    if host.starts_with('/') {
        return Vec::new();
    }
    match tokio::net::lookup_host((host, port)).await {
        Ok(addrs) => addrs.collect(),
        Err(_) => Vec::new(),
    }
}

/// Set `TCP_NODELAY` on every TCP socket of this process whose peer is one of `peers` and that
/// does not have it yet; returns how many were changed. Linux only (it reads `/proc/self/fd`);
/// elsewhere it does nothing and returns 0.
///
/// A socket that is closed (and its descriptor reused) while this runs makes the calls fail or
/// act on another socket with the same peer, which is harmless: the option only changes when
/// small writes are sent.
pub fn set_nodelay_towards(peers: &[SocketAddr]) -> usize {
    if peers.is_empty() {
        return 0;
    }
    imp::set_nodelay_towards(peers)
}

#[cfg(target_os = "linux")]
mod imp {
    use std::net::SocketAddr;
    use std::os::fd::{BorrowedFd, RawFd};
    use std::os::unix::ffi::OsStrExt as _;

    pub(super) fn set_nodelay_towards(peers: &[SocketAddr]) -> usize {
        let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
            return 0;
        };
        let mut changed = 0;
        for entry in dir.flatten() {
            let Some(fd) = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<RawFd>().ok())
            else {
                continue;
            };
            // Sockets only ("socket:[inode]"); skips files, pipes and the directory's own fd.
            match std::fs::read_link(entry.path()) {
                Ok(target) if target.as_os_str().as_bytes().starts_with(b"socket:") => {}
                _ => continue,
            }
            // SAFETY: the descriptor is borrowed for the two socket calls below and never
            // closed here. If its owner closed it meanwhile, the calls fail (EBADF, ENOTSOCK)
            // or reach a socket with the same peer (checked first), which is harmless.
            let fd = unsafe { BorrowedFd::borrow_raw(fd) };
            let socket = socket2::SockRef::from(&fd);
            let Some(peer) = socket.peer_addr().ok().and_then(|a| a.as_socket()) else {
                continue;
            };
            if peers.contains(&peer)
                && socket.tcp_nodelay().is_ok_and(|on| !on)
                && socket.set_tcp_nodelay(true).is_ok()
            {
                changed += 1;
            }
        }
        changed
    }
}

#[cfg(not(target_os = "linux"))]
mod imp {
    pub(super) fn set_nodelay_towards(_: &[std::net::SocketAddr]) -> usize {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A plain tokio connection (no `TCP_NODELAY`, like sqlx 0.9.0's) gets the option; a
    /// connection to another peer does not.
    #[tokio::test]
    async fn sets_the_option_on_sockets_to_the_peer_only() {
        let a = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let b = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let to_a = tokio::net::TcpStream::connect(a.local_addr().unwrap())
            .await
            .unwrap();
        let to_b = tokio::net::TcpStream::connect(b.local_addr().unwrap())
            .await
            .unwrap();
        assert!(!to_a.nodelay().unwrap() && !to_b.nodelay().unwrap());
        let peers = resolve("127.0.0.1", a.local_addr().unwrap().port()).await;
        let changed = set_nodelay_towards(&peers);
        if cfg!(target_os = "linux") {
            assert_eq!(changed, 1);
            assert!(
                to_a.nodelay().unwrap(),
                "the socket to the peer has TCP_NODELAY"
            );
            assert!(
                !to_b.nodelay().unwrap(),
                "another peer's socket is left alone"
            );
            assert_eq!(
                set_nodelay_towards(&peers),
                0,
                "already set: nothing to change"
            );
        }
        assert!(resolve("/var/run/postgresql", 5432).await.is_empty());
    }
}
