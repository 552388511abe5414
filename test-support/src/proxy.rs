//! A TCP proxy that, per connection, forwards normally, delays, or drops the connection after
//! the server has answered but before the answer reaches the client: the "connection lost after
//! the request was executed" fault that at-least-once clients turn into duplicates.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// What the proxy does with one connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Relay both ways.
    Forward,
    /// Relay the request; close both sides as soon as the server starts answering, relaying
    /// nothing of the answer.
    DropAfterRequest,
    /// Relay, but hold each chunk from the server this long.
    Delay(Duration),
    /// Reset the client's connection (RST) as soon as it is accepted, relaying nothing: the
    /// client may already have written its request, so it cannot know whether it was sent.
    /// HTTP/1 only (HTTP/2 responses are never reset).
    Reset,
}

/// The protocol spoken, so the proxy knows when "the server started answering".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// HTTP/1: the mode is chosen per connection, and the first bytes from the server are the
    /// response (use clients that open a connection per request to fault every request).
    Http1,
    /// HTTP/2: one connection carries many calls, so the mode is chosen per response: at every
    /// HEADERS frame the server sends on a stream (SETTINGS, WINDOW_UPDATE and PING frames are
    /// not responses).
    Http2,
}

/// Chooses the mode of each new connection (HTTP/1) or response (HTTP/2).
pub type Chooser = Box<dyn FnMut() -> Mode + Send>;

type SharedChooser = Arc<Mutex<Chooser>>;

/// Counters of what the proxy did.
#[derive(Debug, Default)]
pub struct ProxyStats {
    /// Connections accepted.
    pub connections: AtomicUsize,
    /// Connections dropped after the server answered.
    pub dropped: AtomicUsize,
    /// Connections reset before anything was relayed.
    pub reset: AtomicUsize,
    /// Connections (HTTP/1) or responses (HTTP/2) delayed.
    pub delayed: AtomicUsize,
    /// What the proxy saw of each HTTP/2 connection still open: to tell, when a call hangs,
    /// whether its stream is waiting on the server, on the proxy, or never left the client.
    open_h2: Mutex<std::collections::BTreeMap<u64, Arc<Mutex<H2Trace>>>>,
    /// The last HTTP/2 connections that closed, with their streams unanswered.
    closed_h2: Mutex<std::collections::VecDeque<ClosedH2>>,
    next_id: AtomicUsize,
}

/// An HTTP/2 connection that closed, and its streams unanswered.
#[derive(Debug)]
struct ClosedH2 {
    id: u64,
    /// The client's port.
    peer_port: u16,
    last_stream: u32,
    accepted: std::time::Instant,
    closed: std::time::Instant,
    how: &'static str,
    /// Each unanswered stream and when its request came.
    unanswered: Vec<(u32, std::time::Instant)>,
}

/// What the proxy saw of one HTTP/2 connection: when each stream's request and response
/// started, and how it ended.
#[derive(Debug)]
struct H2Trace {
    /// The client's port.
    peer_port: u16,
    /// The highest stream the client opened (sent HEADERS on).
    last_stream: u32,
    /// When the client's connection was accepted, and when the server's was made.
    accepted: std::time::Instant,
    upstream: Option<std::time::Instant>,
    opened: std::time::Instant,
    streams: std::collections::BTreeMap<u32, StreamTrace>,
    /// GOAWAY frames seen: (from the server?, last stream id).
    goaways: Vec<(bool, u32)>,
    /// Bytes relayed client to server, and server to client.
    up_bytes: u64,
    down_bytes: u64,
    /// How the relay ended, once it has.
    ended: &'static str,
}

#[derive(Debug, Default, Clone, Copy)]
struct StreamTrace {
    request: Option<std::time::Instant>,
    request_ended: bool,
    response: Option<std::time::Instant>,
    response_ended: bool,
    /// RST_STREAM: (from the server?, error code).
    reset: Option<(bool, u32)>,
}

impl H2Trace {
    fn new(peer_port: u16) -> Self {
        H2Trace {
            peer_port,
            last_stream: 0,
            accepted: std::time::Instant::now(),
            upstream: None,
            opened: std::time::Instant::now(),
            streams: Default::default(),
            goaways: Vec::new(),
            up_bytes: 0,
            down_bytes: 0,
            ended: "",
        }
    }

    /// The streams whose request went up and whose response did not end, one line each.
    fn unanswered(&self, now: std::time::Instant, older_than: Duration) -> Vec<String> {
        self.streams
            .iter()
            .filter(|(_, s)| {
                s.request.is_some_and(|at| now - at >= older_than) && !s.response_ended
            })
            .map(|(n, s)| {
                format!(
                    "stream {n}: request {:?} ago (body ended: {}), response {}",
                    now - s.request.unwrap(),
                    s.request_ended,
                    match s.response {
                        Some(at) => format!("started {:?} ago, not ended", now - at),
                        None => "not started".into(),
                    }
                )
            })
            .collect()
    }

    /// Notes the frames of one chunk relayed in one direction.
    fn note(&mut self, from_server: bool, frames: &[(u8, u8, u32, u32)]) {
        const END_STREAM: u8 = 0x1;
        let now = std::time::Instant::now();
        for &(kind, flags, stream, code) in frames {
            if stream == 0 {
                if kind == 0x7 {
                    self.goaways.push((from_server, code & 0x7fff_ffff));
                }
                continue;
            }
            let s = self.streams.entry(stream).or_default();
            let ends = flags & END_STREAM != 0 && matches!(kind, 0x0 | 0x1);
            match (kind, from_server) {
                (0x1, false) => {
                    self.last_stream = self.last_stream.max(stream);
                    s.request.get_or_insert(now);
                    s.request_ended |= ends;
                }
                (0x0, false) => s.request_ended |= ends,
                (0x1, true) => {
                    s.response.get_or_insert(now);
                    s.response_ended |= ends;
                }
                (0x0, true) => s.response_ended |= ends,
                (0x3, _) => s.reset = Some((from_server, code)),
                _ => {}
            }
        }
        // Forget streams that are done, so that a long-lived connection stays small.
        self.streams
            .retain(|_, s| !(s.reset.is_some() || (s.response_ended && s.request_ended)));
    }
}

impl ProxyStats {
    /// What the proxy saw around `at` (a hung call's attempt started then): every HTTP/2
    /// connection open now (when accepted, whether its server connection was made, its streams
    /// still unanswered), and the connections that closed with an unanswered stream whose
    /// request came within 2 s of `at`.
    pub fn h2_report_around(&self, at: std::time::Instant) -> String {
        let now = std::time::Instant::now();
        let ago = |t: std::time::Instant| now.saturating_duration_since(t);
        let near = |t: std::time::Instant| {
            t.saturating_duration_since(at) < Duration::from_secs(2)
                && at.saturating_duration_since(t) < Duration::from_secs(2)
        };
        let mut out = String::new();
        for (id, t) in self.open_h2.lock().unwrap().iter() {
            let t = t.lock().unwrap();
            out.push_str(&format!(
                "open connection {id} (client port {}): accepted {:?} ago, server connection {}, {} bytes up, {} down, GOAWAYs {:?}; unanswered: {:?}\n",
                t.peer_port,
                ago(t.accepted),
                t.upstream.map_or("not made".to_owned(), |u| format!("made {:?} ago", ago(u))),
                t.up_bytes,
                t.down_bytes,
                t.goaways,
                t.unanswered(now, Duration::ZERO)
            ));
        }
        for c in self.closed_h2.lock().unwrap().iter() {
            let near_streams: Vec<(u32, Duration)> = c
                .unanswered
                .iter()
                .filter(|(_, t)| near(*t))
                .map(|(n, t)| (*n, ago(*t)))
                .collect();
            if near_streams.is_empty() {
                continue;
            }
            out.push_str(&format!(
                "closed connection {} (client port {}): accepted {:?} ago, closed {:?} ago ({}); unanswered streams near then (stream, request ago): {:?}\n",
                c.id,
                c.peer_port,
                ago(c.accepted),
                ago(c.closed),
                c.how,
                near_streams
            ));
        }
        out
    }

    /// What the proxy saw of the HTTP/2 connection from the client's `port` (the last one, if
    /// the port was used more than once): open, or closed (among the last 4 096 closed).
    pub fn h2_connection_from(&self, port: u16) -> String {
        let now = std::time::Instant::now();
        let ago = |t: std::time::Instant| now.saturating_duration_since(t);
        for (id, t) in self.open_h2.lock().unwrap().iter() {
            let t = t.lock().unwrap();
            if t.peer_port == port {
                return format!(
                    "open connection {id}: accepted {:?} ago, streams opened up to {}, {} bytes up, {} down, GOAWAYs {:?}; unanswered: {:?}",
                    ago(t.accepted),
                    t.last_stream,
                    t.up_bytes,
                    t.down_bytes,
                    t.goaways,
                    t.unanswered(now, Duration::ZERO)
                );
            }
        }
        let closed = self.closed_h2.lock().unwrap();
        match closed.iter().rev().find(|c| c.peer_port == port) {
            Some(c) => format!(
                "closed connection {}: accepted {:?} ago, closed {:?} ago ({}), streams opened up to {}; unanswered streams (stream, request ago): {:?}",
                c.id,
                ago(c.accepted),
                ago(c.closed),
                c.how,
                c.last_stream,
                c.unanswered
                    .iter()
                    .map(|(n, t)| (*n, ago(*t)))
                    .collect::<Vec<_>>()
            ),
            None => "no connection from that port open, nor among the last closed".into(),
        }
    }

    /// Every HTTP/2 connection still open with a stream whose request has waited longer than
    /// `older_than` for a response (or for its end), described one per line; and a summary.
    pub fn h2_waiting_streams(&self, older_than: Duration) -> String {
        let now = std::time::Instant::now();
        let open = self.open_h2.lock().unwrap();
        let mut out = format!("{} HTTP/2 connections open\n", open.len());
        for (id, t) in open.iter() {
            let t = t.lock().unwrap();
            let waiting = t.unanswered(now, older_than);
            if waiting.is_empty() {
                continue;
            }
            out.push_str(&format!(
                "connection {id} (open {:?}, {} bytes up, {} down, GOAWAYs {:?}):\n  {}\n",
                now - t.opened,
                t.up_bytes,
                t.down_bytes,
                t.goaways,
                waiting.join("\n  ")
            ));
        }
        out
    }
}

/// A running proxy.
#[derive(Debug, Clone)]
pub struct Proxy {
    /// Where clients connect.
    pub addr: SocketAddr,
    /// What it did.
    pub stats: Arc<ProxyStats>,
}

impl Proxy {
    /// Starts a proxy on 127.0.0.1:0 to `upstreams` (round-robin per connection).
    pub async fn start(upstreams: Vec<SocketAddr>, protocol: Protocol, chooser: Chooser) -> Proxy {
        assert!(!upstreams.is_empty());
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let stats = Arc::new(ProxyStats::default());
        let chooser: SharedChooser = Arc::new(Mutex::new(chooser));
        let s = stats.clone();
        tokio::spawn(async move {
            let mut next = 0usize;
            loop {
                let Ok((client, peer)) = listener.accept().await else {
                    return;
                };
                s.connections.fetch_add(1, Ordering::SeqCst);
                let upstream = upstreams[next % upstreams.len()];
                next += 1;
                let (s, chooser) = (s.clone(), chooser.clone());
                tokio::spawn(async move {
                    let _ = relay(client, peer.port(), upstream, protocol, chooser, &s).await;
                });
            }
        });
        Proxy { addr, stats }
    }

    /// Connections dropped after the server answered.
    pub fn dropped(&self) -> usize {
        self.stats.dropped.load(Ordering::SeqCst)
    }
}

/// Picks `DropAfterRequest` with probability `p` from a seeded generator, else `Forward`.
///
pub fn drop_with_probability(p: f64, seed: u64) -> Chooser {
    let mut rng = fastrand::Rng::with_seed(seed);
    Box::new(move || {
        if rng.f64() < p {
            Mode::DropAfterRequest
        } else {
            Mode::Forward
        }
    })
}

async fn relay(
    client: TcpStream,
    peer_port: u16,
    upstream: SocketAddr,
    protocol: Protocol,
    chooser: SharedChooser,
    stats: &ProxyStats,
) -> std::io::Result<()> {
    let choose = || (chooser.lock().unwrap())();
    let connection_mode = match protocol {
        Protocol::Http1 => choose(),
        Protocol::Http2 => Mode::Forward,
    };
    if connection_mode == Mode::Reset {
        stats.reset.fetch_add(1, Ordering::SeqCst);
        // SO_LINGER 0: closing sends RST instead of FIN.
        let _ = client.set_zero_linger();
        return Ok(());
    }
    if matches!(connection_mode, Mode::Delay(_)) {
        stats.delayed.fetch_add(1, Ordering::SeqCst);
    }
    // HTTP/2 connections are traced while they are open (see `ProxyStats::h2_report_around`),
    // from their accept on.
    let trace = (protocol == Protocol::Http2).then(|| {
        let id = stats.next_id.fetch_add(1, Ordering::SeqCst) as u64;
        let t = Arc::new(Mutex::new(H2Trace::new(peer_port)));
        stats.open_h2.lock().unwrap().insert(id, t.clone());
        (id, t)
    });
    let _untrace = Untrace(stats, trace.as_ref().map(|(id, _)| *id));
    let server = TcpStream::connect(upstream).await?;
    if let Some((_, t)) = &trace {
        t.lock().unwrap().upstream = Some(std::time::Instant::now());
    }
    client.set_nodelay(true)?;
    server.set_nodelay(true)?;
    let (mut cr, mut cw) = client.into_split();
    let (mut sr, mut sw) = server.into_split();
    // Set when the HTTP/2 cut closed the client's side with a FIN: the connection then ends
    // without a reset.
    let graceful = std::sync::atomic::AtomicBool::new(false);
    let up = async {
        let mut buf = vec![0u8; 16 * 1024];
        let mut frames = FrameHeaders::client();
        loop {
            let n = cr.read(&mut buf).await?;
            if n == 0 {
                let _ = sw.shutdown().await;
                return Ok::<_, std::io::Error>(());
            }
            if let Some((_, t)) = &trace {
                let mut t = t.lock().unwrap();
                t.up_bytes += n as u64;
                t.note(false, &frames.scan(&buf[..n]));
            }
            sw.write_all(&buf[..n]).await?;
        }
    };
    let down = async {
        let mut buf = vec![0u8; 16 * 1024];
        let mut frames = FrameScanner::default();
        let mut traced = FrameHeaders::default();
        loop {
            let n = sr.read(&mut buf).await?;
            if n == 0 {
                let _ = cw.shutdown().await;
                return Ok(());
            }
            let chunk = &buf[..n];
            if let Some((_, t)) = &trace {
                let mut t = t.lock().unwrap();
                t.down_bytes += n as u64;
                t.note(true, &traced.scan(chunk));
            }
            // The offsets in this chunk where a response starts, and what to do there.
            let mut cuts: Vec<(usize, Mode)> = Vec::new();
            match protocol {
                Protocol::Http1 => cuts.push((0, connection_mode)),
                Protocol::Http2 => {
                    for at in frames.response_headers(chunk) {
                        cuts.push((at, choose()));
                    }
                }
            }
            let mut sent = 0;
            for (at, mode) in cuts {
                match mode {
                    Mode::Forward | Mode::Reset => {}
                    Mode::Delay(d) => {
                        if protocol == Protocol::Http2 {
                            stats.delayed.fetch_add(1, Ordering::SeqCst);
                        }
                        cw.write_all(&chunk[sent..at]).await?;
                        sent = at;
                        tokio::time::sleep(d).await;
                    }
                    Mode::DropAfterRequest => {
                        // Relay what came before the answer, then cut both sides.
                        cw.write_all(&chunk[sent..at]).await?;
                        stats.dropped.fetch_add(1, Ordering::SeqCst);
                        if protocol == Protocol::Http2 {
                            // Over HTTP/2 what came before the cut holds other streams' whole
                            // responses: end with a FIN after them (see below), not a reset.
                            let _ = cw.shutdown().await;
                            graceful.store(true, Ordering::SeqCst);
                        }
                        return Err(std::io::Error::other("dropped by the fault proxy"));
                    }
                }
            }
            cw.write_all(&chunk[sent..]).await?;
        }
    };
    // Whichever side ends first ends the connection (dropping both halves closes the sockets).
    let (ended, how) = tokio::select! {
        r = up => { let how = if r.is_ok() { "the client closed" } else { "reading the client or writing to the server failed" }; (r, how) }
        r = down => { let how = match &r { Ok(()) => "the server closed", Err(e) if e.to_string().contains("fault proxy") => "cut by the proxy", Err(_) => "writing to the client failed" }; (r, how) }
    };
    if let Some((_, t)) = &trace {
        t.lock().unwrap().ended = how;
    }
    if graceful.load(Ordering::SeqCst) {
        // Closing a socket with unread bytes from the client sends a reset, and a client's
        // kernel that gets a reset discards what it had received and not yet read: responses
        // the proxy relayed whole before the cut would be lost mid-stream (a failure after the
        // response started, which no client may retry). So read what the client still sends
        // (it is not relayed: the connection is cut) until it closes, for at most a second.
        let _ = tokio::time::timeout(std::time::Duration::from_secs(1), async {
            let mut buf = vec![0u8; 16 * 1024];
            while matches!(cr.read(&mut buf).await, Ok(n) if n > 0) {}
        })
        .await;
    }
    ended
}

/// Removes a connection's trace when its relay ends.
struct Untrace<'a>(&'a ProxyStats, Option<u64>);

impl Drop for Untrace<'_> {
    fn drop(&mut self) {
        let Some(id) = self.1 else { return };
        let Some(t) = self.0.open_h2.lock().unwrap().remove(&id) else {
            return;
        };
        let t = t.lock().unwrap();
        let unanswered: Vec<(u32, std::time::Instant)> = t
            .streams
            .iter()
            .filter(|(_, s)| !s.response_ended)
            .filter_map(|(n, s)| s.request.map(|at| (*n, at)))
            .collect();
        let mut closed = self.0.closed_h2.lock().unwrap();
        if closed.len() == 4096 {
            closed.pop_front();
        }
        closed.push_back(ClosedH2 {
            id,
            peer_port: t.peer_port,
            last_stream: t.last_stream,
            accepted: t.accepted,
            closed: std::time::Instant::now(),
            how: t.ended,
            unanswered,
        });
    }
}

/// Splits an HTTP/2 byte stream into frames: (type, flags, stream, the first 4 bytes of the
/// payload as a number, for RST_STREAM's error code and GOAWAY's last stream id).
#[derive(Debug, Default)]
struct FrameHeaders {
    /// Bytes to skip first (the client's connection preface).
    skip: usize,
    header: Vec<u8>,
    /// Payload bytes of the current frame still to come, and the first 4 of them.
    left: usize,
    first4: Vec<u8>,
    current: Option<(u8, u8, u32)>,
}

impl FrameHeaders {
    /// The scanner of a client's bytes, which start with the connection preface.
    fn client() -> Self {
        FrameHeaders {
            skip: b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".len(),
            ..FrameHeaders::default()
        }
    }

    fn scan(&mut self, mut chunk: &[u8]) -> Vec<(u8, u8, u32, u32)> {
        let mut out = Vec::new();
        let skip = self.skip.min(chunk.len());
        self.skip -= skip;
        chunk = &chunk[skip..];
        while !chunk.is_empty() {
            if let Some((kind, flags, stream)) = self.current {
                let n = self.left.min(chunk.len());
                let want = 4usize.saturating_sub(self.first4.len()).min(n);
                self.first4.extend_from_slice(&chunk[..want]);
                self.left -= n;
                chunk = &chunk[n..];
                if self.left == 0 {
                    let mut b = [0u8; 4];
                    b[..self.first4.len()].copy_from_slice(&self.first4);
                    out.push((kind, flags, stream, u32::from_be_bytes(b)));
                    self.current = None;
                    self.first4.clear();
                }
                continue;
            }
            let need = 9 - self.header.len();
            let take = need.min(chunk.len());
            self.header.extend_from_slice(&chunk[..take]);
            chunk = &chunk[take..];
            if self.header.len() == 9 {
                let h = std::mem::take(&mut self.header);
                let len = (usize::from(h[0]) << 16) | (usize::from(h[1]) << 8) | usize::from(h[2]);
                let stream = u32::from_be_bytes([h[5] & 0x7f, h[6], h[7], h[8]]);
                self.current = Some((h[3], h[4], stream));
                self.left = len;
                if len == 0 {
                    out.push((h[3], h[4], stream, 0));
                    self.current = None;
                }
            }
        }
        out
    }
}

/// Finds where responses start in a server's HTTP/2 byte stream: the first HEADERS frame of
/// each stream. Later HEADERS frames of a stream are its trailers, sent after the response has
/// started: cutting there would be a failure mid-response, which gRFC A6 forbids retrying.
#[derive(Debug, Default)]
struct FrameScanner {
    /// Streams whose response has started.
    answered: std::collections::HashSet<u32>,
    /// Streams whose response has started and not ended: cutting the connection now would
    /// fail them mid-response.
    open: std::collections::HashSet<u32>,
    /// Bytes of the stream seen so far that do not yet form a whole frame header.
    pending: Vec<u8>,
    /// Bytes of the current frame's payload still to skip.
    skip: usize,
}

impl FrameScanner {
    /// The offsets in `chunk` where responses start while no other response is half-sent:
    /// the places where cutting the connection fails every call on it before its response.
    fn response_headers(&mut self, chunk: &[u8]) -> Vec<usize> {
        let mut found = Vec::new();
        let mut i = 0;
        while i < chunk.len() {
            if self.skip > 0 {
                let n = self.skip.min(chunk.len() - i);
                self.skip -= n;
                i += n;
                continue;
            }
            // Where this frame header starts in the chunk (0 if it began in an earlier one).
            let start = if self.pending.is_empty() { i } else { 0 };
            let need = 9 - self.pending.len();
            let take = need.min(chunk.len() - i);
            self.pending.extend_from_slice(&chunk[i..i + take]);
            i += take;
            if self.pending.len() < 9 {
                return found;
            }
            let h = std::mem::take(&mut self.pending);
            let len = (usize::from(h[0]) << 16) | (usize::from(h[1]) << 8) | usize::from(h[2]);
            let kind = h[3];
            let stream = u32::from_be_bytes([h[5] & 0x7f, h[6], h[7], h[8]]);
            const END_STREAM: u8 = 0x1;
            let flags = h[4];
            match kind {
                // HEADERS: the first on a stream starts its response; a later one is trailers.
                0x1 if stream != 0 => {
                    if self.answered.insert(stream) && self.open.is_empty() {
                        found.push(start);
                    }
                    if flags & END_STREAM == 0 {
                        self.open.insert(stream);
                    } else {
                        self.open.remove(&stream);
                    }
                }
                // DATA ending the stream, or RST_STREAM.
                0x0 if flags & END_STREAM != 0 => {
                    self.open.remove(&stream);
                }
                0x3 => {
                    self.open.remove(&stream);
                }
                _ => {}
            }
            self.skip = len;
        }
        found
    }
}

#[cfg(test)]
mod tests {
    use super::FrameScanner;

    #[test]
    fn finds_headers_after_settings_across_chunks() {
        // SETTINGS (empty, stream 0), then HEADERS on stream 1.
        let mut bytes = vec![0, 0, 0, 0x4, 0, 0, 0, 0, 0];
        bytes.extend_from_slice(&[0, 0, 2, 0x1, 0x4, 0, 0, 0, 1, 0x88, 0x89]);
        let mut s = FrameScanner::default();
        assert!(s.response_headers(&bytes[..5]).is_empty());
        assert_eq!(s.response_headers(&bytes[5..18]), vec![4]);
        assert_eq!(s.response_headers(&bytes[18..]), Vec::<usize>::new());
        // Stream 3 starts while stream 1 is half-sent: not a place to cut. Then stream 1's
        // trailers (not a response start), then stream 5 starts with nothing half-sent... but
        // stream 3 is still open, so only after stream 3's END_STREAM DATA does 7 count.
        let frames = [
            vec![0, 0, 1, 0x1, 0x4, 0, 0, 0, 3, 0x88],
            vec![0, 0, 1, 0x1, 0x5, 0, 0, 0, 1, 0x88],
            vec![0, 0, 1, 0x1, 0x4, 0, 0, 0, 5, 0x88],
            vec![0, 0, 0, 0x0, 0x1, 0, 0, 0, 3],
            vec![0, 0, 0, 0x3, 0x0, 0, 0, 0, 5],
            vec![0, 0, 1, 0x1, 0x5, 0, 0, 0, 7, 0x88],
        ]
        .concat();
        assert_eq!(s.response_headers(&frames), vec![48]);
    }
}

#[cfg(test)]
mod trace_tests {
    use super::{FrameHeaders, H2Trace};

    #[test]
    fn frames_are_split_across_chunks_after_the_preface() {
        let mut bytes = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        // HEADERS on stream 1 (END_HEADERS), then RST_STREAM on stream 1 with code 8.
        bytes.extend_from_slice(&[0, 0, 2, 0x1, 0x4, 0, 0, 0, 1, 0x88, 0x89]);
        bytes.extend_from_slice(&[0, 0, 4, 0x3, 0, 0, 0, 0, 1, 0, 0, 0, 8]);
        let mut f = FrameHeaders::client();
        let mut frames = Vec::new();
        for piece in bytes.chunks(5) {
            frames.extend(f.scan(piece));
        }
        assert_eq!(frames, vec![(0x1, 0x4, 1, 0x8889_0000), (0x3, 0, 1, 8)]);
        let mut t = H2Trace::new(0);
        t.note(false, &frames[..1]);
        assert!(t.streams[&1].request.is_some());
        t.note(false, &frames[1..]);
        assert!(t.streams.is_empty(), "a reset stream is forgotten");
    }
}
