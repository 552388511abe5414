//! The fault model: everything a seed decides. One seed is one [`Schedule`]: the settings of
//! both layers, the business intents the clients send, what each handler does, and the timed
//! faults of the network, the hosts, the store and the clients' inner services.
//!
//! A new fault is one variant here and one place in `world.rs` that applies it.

use std::fmt;
use std::time::Duration;

use idempotency_layer::conformance::{Fault as StoreFault, Op};
use idempotency_layer::store::ScopeKey;
use idempotency_layer::{InFlight, OnDisconnect};

/// The wire protocol the clients speak.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    /// HTTP/1.1 with keep-alive.
    Http1,
    /// HTTP/2 with prior knowledge (h2c).
    Http2,
    /// gRPC: tonic's server and tonic `Channel`s.
    Grpc,
}

/// The settings both layers run with in one seed.
#[derive(Clone, Debug)]
pub struct Settings {
    /// The clients' wire protocol.
    pub protocol: Protocol,
    /// How the servers treat a duplicate of a write in flight.
    pub in_flight: InFlight,
    /// What a server does with a leader whose client went away.
    pub on_disconnect: OnDisconnect,
    /// Whether a server runs writes unprotected when the store is down.
    pub fail_open: bool,
    /// The claim lease, when not the layer's default.
    pub lease: Option<Duration>,
    /// The client policy's `total_timeout` (the call's deadline), if any.
    pub deadline: Option<Duration>,
    /// Hedged requests on the client (a second attempt of a keyed write when the first is slow),
    /// under the retry layer.
    pub hedging: bool,
    /// Hedging alone, with no retry layer above it (it then answers on its own bounds).
    pub hedging_alone: bool,
    /// The hedging delay.
    pub hedge_delay: Duration,
    /// The probability that a message breaks its TCP connection (a reset).
    pub fail_rate: f64,
    /// The handlers make a write of their own to a downstream tier, with derived keys.
    pub chain: bool,
    /// A `ConcurrencyLimit` of this many requests between the server layer and its handlers.
    pub server_limit: Option<usize>,
    /// An HTTP client's stack behind a `tower::buffer::Buffer` of this bound, shared by all its
    /// calls (as a tonic `Channel` is a Buffer): a service tower's contract lets it discard.
    pub client_buffer: Option<usize>,
    /// A `ConcurrencyLimit` of this many calls under an HTTP client's retry layer: the layer's
    /// calls wait for its permits.
    pub client_limit: Option<usize>,
    /// An HTTP/1.1 client's calls share one connection under its layer (as hyper's
    /// `SendRequest`): ready for the next request only once the answer before it is read or let
    /// go.
    pub client_one_connection: bool,
    /// An HTTP client's calls share one service (as a generated client kept in a struct):
    /// each takes it, waits for `ready()`, calls, and gives it back; a call cancelled meanwhile
    /// abandons its `ready()`.
    pub client_reuses_service: bool,
    /// A per-request `retry_layer::Deadline` on every HTTP call, from when the call starts.
    pub call_deadline: Option<Duration>,
    /// With a shared service: a caller gives its call up when `ready()` takes longer.
    pub client_ready_timeout: Option<Duration>,
    /// Number of server instances behind the clients.
    pub servers: usize,
    /// Number of client hosts.
    pub clients: usize,
    /// The memory bounds of both layers, when smaller than their defaults.
    pub bounds: Bounds,
    /// Each server's own settings (a rolling upgrade may give servers different ones).
    pub per_server: Vec<ServerSettings>,
}

/// One server's settings of its layer, when not the layer's default (drawn small, so that
/// seeds reach their bounds).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServerSettings {
    /// The claim lease.
    pub lease: Option<Duration>,
    /// `max_claim_lifetime`.
    pub max_claim_lifetime: Option<Duration>,
    /// `max_detached`.
    pub max_detached: Option<usize>,
    /// `max_wait`.
    pub max_wait: Option<Duration>,
    /// `max_waiters`.
    pub max_waiters: Option<usize>,
    /// The records' `ttl`.
    pub ttl: Option<Duration>,
    /// `request_body_timeout`.
    pub request_body_timeout: Option<Duration>,
}

/// Memory bounds drawn small, so that a seed reaches them (`None`: the layer's default).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Bounds {
    /// The servers' `max_waiting_bytes`: room for one to four waiters (each is charged its body
    /// and 1 KiB).
    pub max_waiting_bytes: Option<usize>,
    /// The clients' `max_replay_bytes_total`: under two request bodies, often under one.
    pub max_replay_bytes_total: Option<usize>,
    /// The store's `max_bytes` and `min_retention`: room for a few records, which make room for
    /// new claims once they are older than the retention.
    pub store: Option<(usize, Duration)>,
    /// The servers' `max_response_buffer_bytes` (HTTP/2 seeds with responses over the 64 KiB
    /// each response may hold whatever it says, and clients that read them slowly under a
    /// small flow-control window).
    pub max_response_buffer_bytes: Option<usize>,
}

/// What a handler does on one execution.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Handler {
    /// Answers 201 with its body.
    Ok,
    /// Answers 500 before doing anything (nothing is recorded; a retry may run it).
    Error,
    /// Answers 503 before doing anything.
    Unavailable,
    /// Panics before answering.
    PanicBeforeHead,
    /// Answers 201, then its body panics at byte `at`.
    PanicInBody {
        /// The byte at which the body panics.
        at: usize,
    },
    /// Answers 201, then its body fails with an error at byte `at`.
    ErrorInBody {
        /// The byte at which the body fails.
        at: usize,
    },
    /// Answers 201, then its body stalls at byte `at` for `stall`.
    StallInBody {
        /// The byte at which the body stalls.
        at: usize,
        /// How long it stalls.
        stall: Duration,
    },
    /// Takes this long before answering 201.
    Slow(Duration),
    /// Never answers.
    NeverEnds,
    /// Answers 201, then its body's `is_end_stream` panics once byte `at` was sent.
    PanicInIsEndStream {
        /// The byte from which it panics.
        at: usize,
    },
    /// Answers 201, then its body's `size_hint` panics once byte `at` was sent.
    PanicInSizeHint {
        /// The byte from which it panics.
        at: usize,
    },
}

/// One business intent: a write with one key, sent by one or more clients.
#[derive(Clone, Debug)]
pub struct Intent {
    /// The idempotency key.
    pub key: String,
    /// The tenant (a header the servers trust in the simulation).
    pub tenant: &'static str,
    /// The request body.
    pub body: Vec<u8>,
    /// The response body's length.
    pub response_len: usize,
    /// Whether the response body announces its length (`Content-Length`) or is chunked.
    pub sized: bool,
    /// The clients that send it (the same key from several clients: concurrent duplicates),
    /// each with its start time and, if any, when its caller gives up (drops the call).
    pub sends: Vec<Send>,
    /// What the handler does on its first execution.
    pub first: Handler,
    /// What it does on its second, third... executions (past the end: [`Handler::Ok`]).
    pub later: Vec<Handler>,
}

impl Intent {
    /// What execution `n` (from 1) does.
    pub fn plan(&self, n: u32) -> Handler {
        match n {
            0 | 1 => self.first,
            n => self
                .later
                .get(n as usize - 2)
                .copied()
                .unwrap_or(Handler::Ok),
        }
    }

    /// The body a send carries: the intent's, or another one under the same key.
    pub fn body_of(&self, send: &Send) -> Vec<u8> {
        if send.other_body {
            let mut b = self.body.clone();
            b.extend_from_slice(b"+other");
            b
        } else {
            self.body.clone()
        }
    }
}

/// One client's send of an intent.
#[derive(Clone, Copy, Debug)]
pub struct Send {
    /// The client host's index.
    pub client: usize,
    /// When the call starts.
    pub at: Duration,
    /// When the caller drops the call, if it does (a cancellation).
    pub cancel_after: Option<Duration>,
    /// The same key with another body (a client bug: expect 422, never a second run).
    pub other_body: bool,
    /// The request body stalls or fails midway (HTTP only: a streaming upload).
    pub body_fault: Option<BodyFault>,
    /// The client reads the response body slowly: this long between frames.
    pub slow_read: Option<Duration>,
}

/// A request body that does not arrive whole at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BodyFault {
    /// It stalls after byte `at` for `stall`, then sends the rest.
    Stall {
        /// The byte after which it stalls.
        at: usize,
        /// How long it stalls.
        stall: Duration,
    },
    /// It fails with an error after byte `at` (the upload broke: its source failed).
    Fail {
        /// The byte after which it fails.
        at: usize,
    },
}

/// A timed fault.
#[derive(Clone, Copy, Debug)]
pub enum Fault {
    /// No message between the client and the server until `heal`.
    Partition {
        /// The client's index.
        client: usize,
        /// The server's index.
        server: usize,
    },
    /// Messages between the client and the server are held (a half-open link) until `heal`.
    Hold {
        /// The client's index.
        client: usize,
        /// The server's index.
        server: usize,
    },
    /// The server crashes; it restarts at `heal`.
    Crash {
        /// The server's index.
        server: usize,
    },
    /// A store fault on the calls of `op` until `heal`: of every server, or of one; on every
    /// key, or on one intent's; on every call, or on the next `times`.
    Store {
        /// The operation.
        op: Option<Op>,
        /// The fault.
        fault: StoreFault,
        /// Only this server's calls.
        server: Option<usize>,
        /// Only calls on this intent's scope.
        intent: Option<usize>,
        /// Only the next this many calls.
        times: Option<usize>,
    },
    /// The client's inner service stops being ready until `heal` (a full Buffer).
    NotReady {
        /// The client's index.
        client: usize,
    },
    /// The client's process crashes (every call in flight is lost with its connections); it
    /// restarts at `heal` and sends again, with the same key, every write that had no answer:
    /// at-least-once delivery, as a queue redelivers what was not acknowledged.
    ClientCrash {
        /// The client's index.
        client: usize,
    },
    /// The server drains for a rolling restart: `IdempotencyLayer::drain` and a graceful
    /// shutdown of its connections (GOAWAY over HTTP/2 and gRPC; HTTP/1.1 connections close
    /// after their request in flight); it restarts at `heal`.
    Drain {
        /// The server's index.
        server: usize,
    },
    /// No message from the client to the server (`to_server`), or from the server to the
    /// client, until `heal`; the other way passes (a one-way partition).
    OneWay {
        /// The client's index.
        client: usize,
        /// The server's index.
        server: usize,
        /// Which way is cut: the client's messages to the server (else the server's replies).
        to_server: bool,
    },
    /// The link between a server and the downstream tier is cut (or held: a half-open link)
    /// until `heal`.
    Downstream {
        /// The server's index.
        server: usize,
        /// Held rather than cut.
        hold: bool,
    },
    /// The service under the server's layer (user code) panics once, in the next `poll_ready`
    /// or `call` it is asked for after `at` (a one-shot: disarmed at `heal` if it never came).
    ServicePanic {
        /// The server's index.
        server: usize,
        /// In `call` (else in `poll_ready`).
        in_call: bool,
    },
}

/// A fault with its time window.
#[derive(Clone, Copy, Debug)]
pub struct Timed {
    /// When it starts.
    pub at: Duration,
    /// When it ends (`None`: never).
    pub heal: Option<Duration>,
    /// What it is.
    pub fault: Fault,
}

/// Everything one seed decides.
#[derive(Clone, Debug)]
pub struct Schedule {
    /// The seed.
    pub seed: u64,
    /// The settings.
    pub settings: Settings,
    /// The intents.
    pub intents: Vec<Intent>,
    /// The timed faults.
    pub faults: Vec<Timed>,
    /// Requests the layer must refuse early (no key, a malformed key, no tenant).
    pub malformed: Vec<Malformed>,
}

/// A write the server layer must refuse before it claims anything.
#[derive(Clone, Copy, Debug)]
pub struct Malformed {
    /// The client that sends it.
    pub client: usize,
    /// When.
    pub at: Duration,
    /// What is wrong with it.
    pub kind: MalformedKind,
}

/// What is wrong with a [`Malformed`] write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MalformedKind {
    /// No idempotency key (400).
    NoKey,
    /// A key that breaks the rules (400).
    BadKey,
    /// No tenant (401).
    NoTenant,
}

/// The tenants intents are spread over (a key may repeat across them: separate scopes).
pub const TENANTS: [&str; 2] = ["acme", "globex"];

impl Schedule {
    /// The schedule of `seed`.
    pub fn draw(seed: u64) -> Schedule {
        let mut rng = fastrand::Rng::with_seed(seed);
        let r = &mut rng;
        let settings = Settings {
            protocol: if r.bool() {
                Protocol::Http1
            } else {
                Protocol::Http2
            },
            in_flight: if r.u8(..4) == 0 {
                InFlight::Reject
            } else {
                InFlight::Wait
            },
            on_disconnect: if r.u8(..3) == 0 {
                OnDisconnect::Release
            } else {
                OnDisconnect::Complete
            },
            fail_open: r.u8(..4) == 0,
            lease: pick(r, 3, |r| {
                Duration::from_millis(500 + 500 * u64::from(r.u8(..8)))
            }),
            deadline: pick(r, 2, |r| {
                Duration::from_millis(300 + 250 * u64::from(r.u8(..24)))
            }),
            hedging: false,
            hedging_alone: false,
            hedge_delay: Duration::from_millis(100),
            fail_rate: 0.0,
            chain: false,
            server_limit: pick(r, 4, |r| 1 + r.usize(..3)),
            client_buffer: None,
            client_limit: None,
            client_one_connection: false,
            client_reuses_service: false,
            call_deadline: None,
            client_ready_timeout: None,
            servers: 2 + r.usize(..2),
            clients: 1 + r.usize(..3),
            bounds: Bounds::default(),
            per_server: Vec::new(),
        };
        let n_intents = 2 + r.usize(..9);
        let mut intents = Vec::with_capacity(n_intents);
        for i in 0..n_intents {
            // A key sometimes repeats for the other tenant: two scopes, two executions.
            let key = if !intents.is_empty() && r.u8(..8) == 0 {
                let prev: &Intent = &intents[r.usize(..intents.len().max(1))];
                prev.key.clone()
            } else {
                format!("key-{seed:x}-{i:03}")
            };
            let tenant = TENANTS[r.usize(..TENANTS.len())];
            if intents
                .iter()
                .any(|o: &Intent| o.key == key && o.tenant == tenant)
            {
                continue;
            }
            let body: Vec<u8> = (0..r.usize(..64)).map(|_| r.alphanumeric() as u8).collect();
            let response_len = r.usize(..300);
            let n_sends = 1 + usize::from(r.u8(..3) == 0) + usize::from(r.u8(..6) == 0);
            let start = Duration::from_millis(r.u64(..3000));
            let sends = (0..n_sends)
                .map(|_| Send {
                    client: r.usize(..settings.clients),
                    at: start + Duration::from_millis(r.u64(..400)),
                    cancel_after: pick(r, 8, |r| Duration::from_millis(r.u64(1..2000))),
                    other_body: false,
                    body_fault: None,
                    slow_read: None,
                })
                .collect();
            let mut first = draw_handler(r, response_len);
            if settings.server_limit.is_some() && first == Handler::NeverEnds {
                // A handler that never ends holds its permit for good: the server's limit is
                // then the application's own wedge, not the layer's.
                first = Handler::Slow(Duration::from_secs(10));
            }
            intents.push(Intent {
                key,
                tenant,
                body,
                response_len,
                sized: r.bool(),
                sends,
                first,
                later: Vec::new(),
            });
        }
        let n_faults = r.usize(..6);
        let faults = (0..n_faults).map(|_| draw_fault(r, &settings)).collect();
        let mut settings = settings;
        // Drawn last, so that adding them left the earlier draws of every seed as they were.
        settings.hedging = r.u8(..3) == 0;
        if r.u8(..3) == 0 {
            settings.protocol = Protocol::Grpc;
        }
        settings.hedge_delay = Duration::from_millis(r.u64(20..800));
        settings.fail_rate = if r.u8(..4) == 0 {
            f64::from(r.u8(1..20)) / 1000.0
        } else {
            0.0
        };
        settings.chain = r.u8(..3) == 0;
        let malformed = (0..r.usize(..4))
            .map(|_| Malformed {
                client: r.usize(..settings.clients),
                at: Duration::from_millis(r.u64(..4000)),
                kind: match r.u8(..3) {
                    0 => MalformedKind::NoKey,
                    1 => MalformedKind::BadKey,
                    _ => MalformedKind::NoTenant,
                },
            })
            .collect();
        settings.hedging_alone = settings.hedging && r.u8(..2) == 0;
        settings.bounds = Bounds {
            max_waiting_bytes: pick(r, 2, |r| r.usize(1100..4200)),
            max_replay_bytes_total: pick(r, 2, |r| r.usize(..128)),
            store: None,
            max_response_buffer_bytes: None,
        };
        let mut faults: Vec<Timed> = faults;
        for _ in 0..r.usize(..3) {
            let at = Duration::from_millis(r.u64(..5000));
            let heal = Some(at + Duration::from_millis(r.u64(50..4000)));
            let fault = if r.bool() {
                Fault::ClientCrash {
                    client: r.usize(..settings.clients),
                }
            } else {
                Fault::Drain {
                    server: r.usize(..settings.servers),
                }
            };
            faults.push(Timed { at, heal, fault });
        }
        adversary(r, &mut settings, &mut intents, &mut faults);
        // Drawn after every other draw (issue 51), so that each seed's earlier schedule stays
        // as it was: how a client composes the layer, as users do.
        settings.client_buffer = pick(r, 3, |r| 1 + r.usize(..4));
        settings.client_limit = pick(r, 3, |r| 1 + r.usize(..3));
        let one_connection = r.u8(..3) == 0;
        settings.client_one_connection = one_connection && settings.protocol == Protocol::Http1;
        let http = settings.protocol != Protocol::Grpc;
        settings.client_reuses_service = r.u8(..3) == 0 && http;
        settings.call_deadline =
            pick(r, 4, |r| Duration::from_millis(500 + r.u64(..5_000))).filter(|_| http);
        settings.client_ready_timeout = pick(r, 2, |r| Duration::from_millis(100 + r.u64(..2_000)))
            .filter(|_| settings.client_reuses_service);
        Schedule {
            seed,
            settings,
            intents,
            faults,
            malformed,
        }
    }

    /// The store key of `tenant`'s write with `key`, as the servers' layers compute it.
    pub fn scope_key(&self, tenant: &str, key: &str) -> ScopeKey {
        let method = if self.settings.protocol == Protocol::Grpc {
            idempotency_layer::Scope::grpc_operation(crate::grpc::PUT)
        } else {
            idempotency_layer::Scope::http_operation(&http::Method::POST, &format!("/w/{key}"))
        };
        idempotency_layer::Scope::new(tenant, &method, key).key()
    }
}

/// The adversary's draws (issue 50), made after every earlier draw so that each seed's earlier
/// schedule stays as it was: per-server settings drawn small (a rolling upgrade), handler
/// faults on later runs and in every body method, the same key with another body, many
/// duplicates of one key at once, and store faults of every kind the fault store has, on one
/// server, one key or the next few calls.
fn adversary(
    r: &mut fastrand::Rng,
    settings: &mut Settings,
    intents: &mut [Intent],
    faults: &mut Vec<Timed>,
) {
    adversary_first(r, settings, intents, faults);
    // Drawn after the rest, so that the draws above stay as they were.
    settings.bounds.store = pick(r, 5, |r| (r.usize(1_500..8_000), ms(r, ..2000)));
    adversary_second(r, settings, intents, faults);
}

/// The adversary's second round of draws (after every earlier one, so that each seed's
/// earlier schedule stays as it was): one-way partitions, faults on the links to the downstream
/// tier, user services that panic in `poll_ready` or `call`, and request bodies that stall or
/// fail midway, against a `request_body_timeout` drawn small.
fn adversary_second(
    r: &mut fastrand::Rng,
    settings: &mut Settings,
    intents: &mut [Intent],
    faults: &mut Vec<Timed>,
) {
    let window = |r: &mut fastrand::Rng| {
        let at = ms(r, ..5000);
        (at, Some(at + ms(r, 50..4000)))
    };
    for _ in 0..pick(r, 4, |r| 1 + r.usize(..2)).unwrap_or(0) {
        let (at, heal) = window(r);
        let fault = Fault::OneWay {
            client: r.usize(..settings.clients),
            server: r.usize(..settings.servers),
            to_server: r.bool(),
        };
        faults.push(Timed { at, heal, fault });
    }
    if settings.chain {
        for _ in 0..pick(r, 3, |r| 1 + r.usize(..2)).unwrap_or(0) {
            let (at, heal) = window(r);
            let fault = Fault::Downstream {
                server: r.usize(..settings.servers),
                hold: r.u8(..3) == 0,
            };
            faults.push(Timed { at, heal, fault });
        }
    }
    for _ in 0..pick(r, 6, |r| 1 + r.usize(..2)).unwrap_or(0) {
        let (at, heal) = window(r);
        let fault = Fault::ServicePanic {
            server: r.usize(..settings.servers),
            in_call: r.bool(),
        };
        faults.push(Timed { at, heal, fault });
    }
    if settings.protocol != Protocol::Grpc && r.u8(..4) == 0 {
        for intent in intents.iter_mut() {
            let len = intent.body.len();
            for send in intent.sends.iter_mut() {
                if r.u8(..4) != 0 {
                    continue;
                }
                let at = r.usize(..=len);
                send.body_fault = Some(if r.bool() {
                    BodyFault::Stall {
                        at,
                        stall: ms(r, 10..4000),
                    }
                } else {
                    BodyFault::Fail { at }
                });
            }
        }
        let timeout = pick(r, 2, |r| ms(r, 200..3000));
        for s in settings.per_server.iter_mut() {
            s.request_body_timeout = timeout;
        }
    }
    // Responses over the 64 KiB each may hold for its client, read slowly over HTTP/2 (whose
    // flow control then reaches the server), against a small `max_response_buffer_bytes`.
    if settings.protocol == Protocol::Http2 && !intents.is_empty() && r.u8(..4) == 0 {
        settings.bounds.max_response_buffer_bytes = Some(r.usize(1024..64 * 1024));
        for _ in 0..1 + r.usize(..2) {
            let i = r.usize(..intents.len());
            let intent = &mut intents[i];
            // Past the 64 KiB the client's window lets through and the 64 KiB the response
            // may hold whatever the bound says.
            intent.response_len = 128 * 1024 + r.usize(1..192 * 1024);
            for send in intent.sends.iter_mut() {
                if r.u8(..4) != 0 {
                    send.slow_read = Some(ms(r, 20..300));
                }
            }
        }
    }
}

fn adversary_first(
    r: &mut fastrand::Rng,
    settings: &mut Settings,
    intents: &mut [Intent],
    faults: &mut Vec<Timed>,
) {
    let lease = settings.lease.unwrap_or(Duration::from_secs(30));
    let base = ServerSettings {
        lease: settings.lease,
        max_claim_lifetime: pick(r, 6, |r| lease * (1 + r.u32(..4)) + ms(r, ..3000)),
        max_detached: pick(r, 6, |r| r.usize(..3)),
        max_wait: pick(r, 5, |r| ms(r, 100..4000)),
        max_waiters: pick(r, 5, |r| r.usize(..3)),
        ttl: pick(r, 6, |r| ms(r, 1000..8000)),
        request_body_timeout: None,
    };
    let upgrade = r.u8(..5) == 0;
    settings.per_server = (0..settings.servers)
        .map(|_| {
            let mut s = base;
            if upgrade && r.bool() {
                s.lease = Some(ms(r, 500..4500));
                s.max_waiters = pick(r, 2, |r| r.usize(..3));
            }
            s
        })
        .collect();
    let no_never = settings.server_limit.is_some();
    for intent in intents.iter_mut() {
        let len = intent.response_len;
        if r.u8(..4) == 0 {
            let n = 1 + r.usize(..2);
            intent.later = (0..n)
                .map(|_| {
                    let h = draw_handler(r, len);
                    if no_never && h == Handler::NeverEnds {
                        Handler::Slow(Duration::from_secs(10))
                    } else {
                        h
                    }
                })
                .collect();
        }
        if r.u8(..30) == 0 {
            let at = r.usize(..=len);
            intent.first = if r.bool() {
                Handler::PanicInIsEndStream { at }
            } else {
                Handler::PanicInSizeHint { at }
            };
        }
        if r.u8(..10) == 0 {
            let first = intent.sends[0];
            intent.sends.push(Send {
                client: r.usize(..settings.clients),
                at: first.at + ms(r, ..600),
                cancel_after: None,
                other_body: true,
                body_fault: None,
                slow_read: None,
            });
        }
    }
    if !intents.is_empty() && r.u8(..6) == 0 {
        // Many duplicates of one key at once: enough to reach `max_waiters`.
        let i = r.usize(..intents.len());
        let at = intents[i].sends[0].at;
        for _ in 0..4 + r.usize(..9) {
            intents[i].sends.push(Send {
                client: r.usize(..settings.clients),
                at: at + ms(r, ..60),
                cancel_after: pick(r, 8, |r| ms(r, 1..2000)),
                other_body: false,
                body_fault: None,
                slow_read: None,
            });
        }
    }
    let n = r.usize(..4);
    for _ in 0..n {
        let at = ms(r, ..5000);
        let heal = Some(at + ms(r, 50..4000));
        let op = match r.u8(..7) {
            0 => None,
            1 => Some(Op::Begin),
            2 => Some(Op::Complete),
            3 => Some(Op::Release),
            4 => Some(Op::Wait),
            _ => Some(Op::RenewMany),
        };
        let fault = match r.u8(..9) {
            0 => StoreFault::Fail,
            1 => StoreFault::Corrupt,
            2 => StoreFault::Full,
            3 => StoreFault::Hang,
            4 => StoreFault::Delay(ms(r, 1..(lease.as_millis() as u64 * 3 / 2).max(2))),
            5 => StoreFault::DelayReply(ms(r, 1..(lease.as_millis() as u64 * 3 / 2).max(2))),
            6 => StoreFault::LoseReply,
            7 => StoreFault::HangAfter,
            _ => StoreFault::Ack,
        };
        // `Ack` answers success for operations whose success carries nothing: never a `begin`.
        let fault = match (fault, op) {
            (StoreFault::Ack, None | Some(Op::Begin)) => StoreFault::Fail,
            (f, _) => f,
        };
        let server = pick(r, 2, |r| r.usize(..settings.servers));
        let intent = if intents.is_empty() {
            None
        } else {
            pick(r, 3, |r| r.usize(..intents.len()))
        };
        let times = pick(r, 2, |r| 1 + r.usize(..5));
        faults.push(Timed {
            at,
            heal,
            fault: Fault::Store {
                op,
                fault,
                server,
                intent,
                times,
            },
        });
    }
    // The holes of issue 50, each a fault of its own: a `begin` answered close to a lease late,
    // and a few `renew_many` calls that never answer.
    if r.u8(..5) == 0 {
        let at = ms(r, ..4000);
        let d = lease.mul_f64(0.5 + r.f64() * 0.7);
        faults.push(Timed {
            at,
            heal: Some(at + ms(r, 100..3000)),
            fault: Fault::Store {
                op: Some(Op::Begin),
                fault: StoreFault::DelayReply(d),
                server: pick(r, 2, |r| r.usize(..settings.servers)),
                intent: None,
                times: pick(r, 2, |r| 1 + r.usize(..3)),
            },
        });
    }
    if r.u8(..5) == 0 {
        let at = ms(r, ..3000);
        faults.push(Timed {
            at,
            heal: Some(at + ms(r, 100..2000)),
            fault: Fault::Store {
                op: Some(Op::RenewMany),
                fault: if r.bool() {
                    StoreFault::Hang
                } else {
                    StoreFault::HangAfter
                },
                server: pick(r, 2, |r| r.usize(..settings.servers)),
                intent: None,
                times: Some(1 + r.usize(..6)),
            },
        });
    }
}

fn ms(r: &mut fastrand::Rng, range: impl std::ops::RangeBounds<u64>) -> Duration {
    Duration::from_millis(r.u64(range))
}

/// `Some(f())` one time in `one_in`.
fn pick<T>(
    r: &mut fastrand::Rng,
    one_in: u8,
    f: impl FnOnce(&mut fastrand::Rng) -> T,
) -> Option<T> {
    if r.u8(..one_in) == 0 {
        Some(f(r))
    } else {
        None
    }
}

fn draw_handler(r: &mut fastrand::Rng, len: usize) -> Handler {
    let at = r.usize(..=len);
    match r.u8(..20) {
        0 => Handler::Error,
        1 => Handler::Unavailable,
        2 => Handler::PanicBeforeHead,
        3 => Handler::PanicInBody { at },
        4 => Handler::ErrorInBody { at },
        5 => Handler::StallInBody {
            at,
            stall: Duration::from_millis(r.u64(10..4000)),
        },
        6 | 7 => Handler::Slow(Duration::from_millis(r.u64(10..5000))),
        8 => Handler::NeverEnds,
        _ => Handler::Ok,
    }
}

fn draw_fault(r: &mut fastrand::Rng, s: &Settings) -> Timed {
    let at = Duration::from_millis(r.u64(..5000));
    let heal = Some(at + Duration::from_millis(r.u64(50..4000)));
    let fault = match r.u8(..10) {
        0 | 1 => Fault::Partition {
            client: r.usize(..s.clients),
            server: r.usize(..s.servers),
        },
        2 => Fault::Hold {
            client: r.usize(..s.clients),
            server: r.usize(..s.servers),
        },
        3 | 4 => Fault::Crash {
            server: r.usize(..s.servers),
        },
        5..=7 => {
            let op = match r.u8(..8) {
                0 => None,
                1 | 2 => Some(Op::Begin),
                3 | 4 => Some(Op::Complete),
                5 => Some(Op::Release),
                6 => Some(Op::Wait),
                _ => Some(Op::RenewMany),
            };
            let fault = match r.u8(..6) {
                0 | 1 => StoreFault::Fail,
                2 => StoreFault::Delay(Duration::from_millis(r.u64(1..1500))),
                3 => StoreFault::LoseReply,
                4 => StoreFault::Full,
                _ => StoreFault::Hang,
            };
            // `Full` means "no room for a new claim": only a claim can meet it.
            let fault = match (fault, op) {
                (StoreFault::Full, Some(Op::Begin)) | (StoreFault::Full, None) => {
                    return Timed {
                        at,
                        heal,
                        fault: Fault::Store {
                            op: Some(Op::Begin),
                            fault: StoreFault::Full,
                            server: None,
                            intent: None,
                            times: None,
                        },
                    }
                }
                (f, _) => f,
            };
            let fault = if fault == StoreFault::Full {
                StoreFault::Fail
            } else {
                fault
            };
            Fault::Store {
                op,
                fault,
                server: None,
                intent: None,
                times: None,
            }
        }
        _ => Fault::NotReady {
            client: r.usize(..s.clients),
        },
    };
    // A client whose service never becomes ready again: the readiness bound must end its calls.
    let heal = if matches!(fault, Fault::NotReady { .. }) && r.u8(..3) == 0 {
        None
    } else {
        heal
    };
    Timed { at, heal, fault }
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "seed {}: {:?}", self.seed, self.settings)?;
        for i in &self.intents {
            writeln!(
                f,
                "  intent {} tenant {} first {:?} sends {:?}",
                i.key, i.tenant, i.first, i.sends
            )?;
        }
        for t in &self.faults {
            writeln!(f, "  fault {:?} at {:?} heal {:?}", t.fault, t.at, t.heal)?;
        }
        for m in &self.malformed {
            writeln!(f, "  malformed {m:?}")?;
        }
        Ok(())
    }
}
