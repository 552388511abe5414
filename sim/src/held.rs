//! What a client's layers hold of its request bodies, seen from outside the layers, to check
//! that every byte they keep for a retry is counted in their replay memory.
//!
//! Each frame an HTTP client's request body yields is a `Bytes` whose owner counts itself
//! (`counted`): its bytes are alive until the last clone of it goes, wherever that clone is.
//! Around them the world notes, by call:
//! - whether the call is inside its client's layers (from `call` until the layers answer);
//! - how many attempts of it the router handed to the transport, and how many of those
//!   attempts' bodies the transport still holds (a body the router wrapped, until it is
//!   dropped).
//!
//! A call inside its layers, with an attempt sent and no attempt's body in the transport, has
//! its frames' bytes alive only because the layers keep them: for a retry (or a hedge). After
//! every step, the bytes so kept by a client's calls must not exceed what its layers count
//! (`RetryStats::replay_bytes` plus `HedgeStats::replay_bytes`). The first time they do, it is
//! noted; the invariants report it under promise 5.

use std::collections::BTreeMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;

/// Reads how many request bytes one layer of a client counts now.
pub type Counted = Arc<dyn Fn() -> u64 + Send + Sync>;

/// One call's holdings.
#[derive(Debug, Default)]
struct CallHeld {
    client: usize,
    /// Bytes of the call's body frames still alive.
    live: u64,
    /// The call is inside its client's layers.
    in_layer: bool,
    /// Attempts the router handed to the transport.
    sent: u32,
    /// Attempts' bodies the transport holds now.
    in_transport: u32,
}

/// The first time a client's layers kept more bytes than they counted.
#[derive(Clone, Debug)]
pub struct Uncounted {
    /// When.
    pub at: Duration,
    /// The client.
    pub client: usize,
    /// Bytes its calls' frames kept alive while only its layers held them.
    pub held: u64,
    /// Bytes its layers counted then.
    pub counted: u64,
    /// The calls that held them, with their bytes.
    pub calls: Vec<(usize, u64)>,
}

#[derive(Default)]
struct State {
    calls: BTreeMap<usize, CallHeld>,
    /// Each client's layers' counters, by layer kind (a restarted client's new layers replace
    /// its old ones).
    counted: BTreeMap<(usize, &'static str), Counted>,
    first: Option<Uncounted>,
}

/// The holdings of every client's calls (one per seed, shared).
#[derive(Clone, Default)]
pub struct Holdings(Arc<Mutex<State>>);

impl std::fmt::Debug for Holdings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Holdings").finish_non_exhaustive()
    }
}

impl Holdings {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn with(&self, call: usize, f: impl FnOnce(&mut CallHeld)) {
        f(self.lock().calls.entry(call).or_default());
    }

    /// How many bytes layer `kind` of client `client` counts (replacing an earlier boot's).
    pub fn counter(&self, client: usize, kind: &'static str, counted: Counted) {
        self.lock().counted.insert((client, kind), counted);
    }

    /// `data`, as a frame of call `call` of client `client`, its bytes counted while alive.
    pub fn counted(&self, client: usize, call: usize, data: Bytes) -> Bytes {
        let len = data.len() as u64;
        self.with(call, |c| {
            c.client = client;
            c.live += len;
        });
        Bytes::from_owner(Frame {
            data,
            call,
            held: self.clone(),
        })
    }

    /// Call `call` is inside its layers until the guard goes.
    pub fn in_layer(&self, call: usize) -> InLayer {
        self.with(call, |c| c.in_layer = true);
        InLayer {
            call,
            held: self.clone(),
        }
    }

    /// `body`, an attempt of call `call` handed to the transport, noted while the transport
    /// holds it.
    pub fn in_transport<B>(&self, call: Option<usize>, body: B) -> InTransport<B> {
        if let Some(call) = call {
            self.with(call, |c| {
                c.sent += 1;
                c.in_transport += 1;
            });
        }
        InTransport {
            body,
            call,
            held: self.clone(),
        }
    }

    /// Compares what each client's calls keep alive only in its layers with what its layers
    /// count: the first excess, once.
    pub fn check(&self, at: Duration) -> Option<Uncounted> {
        let mut s = self.lock();
        if s.first.is_some() {
            return None;
        }
        let mut kept: BTreeMap<usize, Vec<(usize, u64)>> = BTreeMap::new();
        for (call, c) in &s.calls {
            if c.in_layer && c.sent > 0 && c.in_transport == 0 && c.live > 0 {
                kept.entry(c.client).or_default().push((*call, c.live));
            }
        }
        for (client, calls) in kept {
            let held: u64 = calls.iter().map(|(_, n)| n).sum();
            let counted: u64 = s
                .counted
                .range((client, "")..)
                .take_while(|((c, _), _)| *c == client)
                .map(|(_, f)| f())
                .sum();
            if held > counted {
                let first = Uncounted {
                    at,
                    client,
                    held,
                    counted,
                    calls,
                };
                s.first = Some(first.clone());
                return Some(first);
            }
        }
        None
    }
}

/// A frame's bytes, counted while alive.
struct Frame {
    data: Bytes,
    call: usize,
    held: Holdings,
}

impl AsRef<[u8]> for Frame {
    fn as_ref(&self) -> &[u8] {
        &self.data
    }
}

impl Drop for Frame {
    fn drop(&mut self) {
        let len = self.data.len() as u64;
        self.held.with(self.call, |c| c.live -= len);
    }
}

/// Marks a call inside its layers while alive.
#[derive(Debug)]
pub struct InLayer {
    call: usize,
    held: Holdings,
}

impl Drop for InLayer {
    fn drop(&mut self) {
        self.held.with(self.call, |c| c.in_layer = false);
    }
}

pin_project_lite::pin_project! {
    /// An attempt's body, noted as held by the transport while alive.
    pub struct InTransport<B> {
        #[pin]
        body: B,
        call: Option<usize>,
        held: Holdings,
    }

    impl<B> PinnedDrop for InTransport<B> {
        fn drop(this: Pin<&mut Self>) {
            let this = this.project();
            if let Some(call) = *this.call {
                this.held.with(call, |c| c.in_transport -= 1);
            }
        }
    }
}

impl<B: http_body::Body> http_body::Body for InTransport<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<B::Data>, B::Error>>> {
        self.project().body.poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}
