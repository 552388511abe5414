//! A TCP proxy that can hold back a server's replies: the request runs on the server, its reply
//! arrives after the client gave up (a lost reply, a dropped request).

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;

/// A TCP proxy that, while `hold` is set, delays every reply from the server by `by`: the
/// request runs on the server, its reply arrives after the client has timed out.
#[derive(Debug)]
pub struct SlowReplies {
    /// Where clients connect.
    pub addr: SocketAddr,
    /// While set, every reply is delayed.
    pub hold: Arc<std::sync::atomic::AtomicBool>,
    accept: tokio::task::JoinHandle<()>,
}

impl Drop for SlowReplies {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

impl SlowReplies {
    /// Relays to `upstream` (`host:port`), delaying replies by `by` while [`hold`](Self::hold)
    /// is set.
    pub async fn start(upstream: &str, by: Duration) -> SlowReplies {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let upstream = tokio::net::lookup_host(upstream)
            .await
            .unwrap()
            .next()
            .unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let hold = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let h = hold.clone();
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(upstream).await else {
                    continue;
                };
                let hold = h.clone();
                tokio::spawn(async move {
                    let (mut cr, mut cw) = client.into_split();
                    let (mut sr, mut sw) = server.into_split();
                    let up = tokio::io::copy(&mut cr, &mut sw);
                    let down = async {
                        let mut buf = vec![0u8; 16 * 1024];
                        loop {
                            let n = sr.read(&mut buf).await?;
                            if n == 0 {
                                return Ok::<_, std::io::Error>(());
                            }
                            if hold.load(Ordering::SeqCst) {
                                tokio::time::sleep(by).await;
                            }
                            cw.write_all(&buf[..n]).await?;
                        }
                    };
                    let _ = tokio::join!(up, down);
                });
            }
        });
        SlowReplies { addr, hold, accept }
    }
}
