//! What happened in one seed, as the invariants read it: every execution of a handler, every
//! call a client made and how it ended, every panic, and a trace of events by key.
//!
//! One `Ledger` per seed, shared by every host of the simulation (they run on one thread).

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// The scope of a write as the simulation names it: tenant and key (one method).
pub type ScopeName = (String, String);

/// One execution of a handler whose side effect happened (it answered a success).
#[derive(Clone, Debug)]
pub struct Execution {
    /// The server that ran it.
    pub server: usize,
    /// The boot of that server (a crash and restart starts the next).
    pub boot: u32,
    /// When the handler started (its claim was taken just before).
    pub started: Duration,
    /// When the side effect happened.
    pub at: Duration,
    /// The attempt that ran it (the tag the client's router stamps on each attempt).
    pub attempt: Option<u64>,
    /// The status and body the handler produced.
    pub status: u16,
    /// The body it meant to send (all of it, whether or not it got out).
    pub body: Vec<u8>,
    /// Its gRPC response broke off (the body failed or panicked) before its status, which a
    /// gRPC response gives in its trailers: its answer is a failure the table does not record.
    pub broke_before_status: bool,
    /// Its name (`tenant/key#n`), which its answer carries in `x-sim-execution`.
    pub name: Option<String>,
}

/// The client layer a retry budget pays for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum BudgetOf {
    /// `RetryLayer`: a retry.
    Retry,
    /// `HedgeLayer`: a hedge.
    Hedge,
}

/// How one client call ended.
#[derive(Clone, Debug)]
pub enum Ending {
    /// A response, read to its end (or to a body error).
    Response {
        /// Its status.
        status: u16,
        /// Whether it said `idempotent-replayed: true`.
        replayed: bool,
        /// Whether it said its recorded body was omitted.
        body_omitted: bool,
        /// The reason code header, if any.
        reason: Option<String>,
        /// The body bytes read.
        body: Vec<u8>,
        /// A body that ended in an error: its text.
        body_error: Option<String>,
        /// The `content-length` header, if any.
        content_length: Option<u64>,
        /// The execution its `x-sim-execution` header names, if any.
        execution: Option<String>,
        /// Its `content-type`, if any.
        content_type: Option<String>,
    },
    /// The layer answered an error.
    Error(String),
    /// The caller dropped the call (a cancellation the schedule asked for).
    Cancelled,
    /// The client's process crashed with the call in flight.
    Crashed,
}

/// One client call.
#[derive(Clone, Debug)]
pub struct CallRecord {
    /// The client.
    pub client: usize,
    /// The scope.
    pub scope: ScopeName,
    /// The request body it sent.
    pub sent: Vec<u8>,
    /// When it started.
    pub start: Duration,
    /// When the call took its service (a shared one may be taken by another call first).
    pub took_service: Option<Duration>,
    /// When the layer answered (a response head or an error).
    pub head: Option<Duration>,
    /// When it ended, and how (`None`: it never ended).
    pub end: Option<(Duration, Ending)>,
}

/// A panic seen anywhere in the simulation.
#[derive(Clone, Debug)]
pub struct PanicRecord {
    /// `file:line` of the panic.
    pub location: String,
    /// Its message.
    pub message: String,
}

/// Everything one seed observed.
#[derive(Debug, Default)]
pub struct Observed {
    /// Executions whose side effect happened, by scope.
    pub executions: BTreeMap<ScopeName, Vec<Execution>>,
    /// Every call, in the order they started.
    pub calls: Vec<CallRecord>,
    /// Each server's crashes, as sim times.
    pub crashes: BTreeMap<usize, Vec<Duration>>,
    /// Every panic.
    pub panics: Vec<PanicRecord>,
    /// Events by scope, for the trace of a failing seed.
    pub trace: Vec<(Duration, String)>,
    /// Faults injected, by kind.
    pub faults: BTreeMap<&'static str, u64>,
    /// The final probe of each server: the status of a fresh write, or why there was none.
    pub probes: Vec<(usize, Result<u16, String>)>,
    /// The most memory each kind of holding reached, read after every step.
    pub peaks: Memory,
    /// The sends (of writes and malformed writes) that ended, by client: a restarted client
    /// sends the others again.
    pub sends_ended: std::collections::BTreeSet<(usize, SendId)>,
    /// The runs (by attempt) that ended without their side effect (failed, panicked, cancelled),
    /// and when.
    pub runs_ended_undone: BTreeMap<u64, Duration>,
    /// Each server's restarts (a new boot after a crash or a drain), as sim times.
    pub restarts: BTreeMap<usize, Vec<Duration>>,
    /// Each server's drains: when each began (the layer's `drain`), and when the restart came.
    pub drains: BTreeMap<usize, Vec<(Duration, Option<Duration>)>>,
    /// Handlers that received a request body none of their intent's sends carried.
    pub wrong_bodies: Vec<(ScopeName, String)>,
    /// Which call each attempt tag belongs to (the clients' routers note it).
    pub attempt_calls: BTreeMap<u64, usize>,
    /// The calls whose client stack received an answer that their key was in flight
    /// (`IDEMPOTENCY_IN_FLIGHT`).
    pub calls_told_in_flight: std::collections::BTreeSet<usize>,
    /// The attempts sent after their call's client had been told its key was in flight.
    pub attempts_sent_knowing: std::collections::BTreeSet<u64>,
    /// The servers' layer statistics at the end of the seed, after the quiescence probe.
    pub final_stats: Vec<(usize, idempotency_layer::IdempotencyStats)>,
    /// The first time a client's layers kept request bytes for replay that they did not count
    /// (see [`crate::held`]).
    pub uncounted_replay: Option<crate::held::Uncounted>,
    /// Every fault has healed and the quiescence step runs: handlers run as planned no more
    /// (a run they start answers at once).
    pub healed: bool,
    /// When the quiescence probe began (every fault healed).
    pub probing_from: Option<Duration>,
    /// The clients' retry-budget tokens held, by the layer they pay for: each granted adds
    /// one, each given back takes one.
    pub budget_tokens: BTreeMap<BudgetOf, i64>,
    /// The requests each call's retry layer handed on (to a hedge, or the client under it).
    pub handoffs: BTreeMap<usize, i64>,
    /// The attempts that reached the wire for each request handed on, by its serial number.
    pub handoff_attempts: BTreeMap<u64, i64>,
    /// Serial numbers given so far.
    pub handoff_serials: u64,
    /// The calls that waited to send an attempt on a one-connection client while an answer of
    /// their own held that connection, unread (the service saw both, at two times of the
    /// simulation's clock), and when each wait began.
    pub waited_on_themselves: BTreeMap<usize, Duration>,
    /// The downstream writes the downstream tier received, by the upstream attempt whose
    /// handler run made them (its tag; replays included: the count is taken in front of the
    /// downstream layer).
    pub down_received: BTreeMap<u64, u32>,
    /// The tagged attempts that reached a server (noted in front of everything it runs), with
    /// the attempts before them their request said (`x-previous-attempts` or
    /// `grpc-previous-rpc-attempts`; 0 when it said none).
    pub arrived: BTreeMap<u64, u32>,
    /// The handler runs whose downstream write failed without telling their hop how it ended
    /// (by the upstream attempt that carried them).
    pub hops_untold: Vec<(ScopeName, Option<u64>)>,
}

/// Reads a server layer's statistics.
pub type StatsReader = Arc<dyn Fn() -> idempotency_layer::IdempotencyStats + Send + Sync>;

/// One send of a client's share of the schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum SendId {
    /// Send `send` of intent `intent`.
    Write {
        /// The intent's index.
        intent: usize,
        /// The send's index among the intent's.
        send: usize,
    },
    /// Malformed write `index`.
    Malformed(usize),
}

/// The memory the layers and the store hold, by kind: what their bounds bound.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Memory {
    /// Bytes held by a server layer's waiters (`IdempotencyStats::waiting_bytes`).
    pub waiting_bytes: u64,
    /// Response bytes a server layer holds for its clients
    /// (`IdempotencyStats::response_buffer_bytes`).
    pub response_buffer_bytes: u64,
    /// Request bytes a client layer keeps for replay (`RetryStats::replay_bytes`).
    pub replay_bytes: u64,
    /// Bytes of the store's entries (`MemoryStats::bytes`).
    pub store_bytes: u64,
}

impl Memory {
    /// Each kind's larger value.
    pub fn max(self, o: Memory) -> Memory {
        Memory {
            waiting_bytes: self.waiting_bytes.max(o.waiting_bytes),
            response_buffer_bytes: self.response_buffer_bytes.max(o.response_buffer_bytes),
            replay_bytes: self.replay_bytes.max(o.replay_bytes),
            store_bytes: self.store_bytes.max(o.store_bytes),
        }
    }
}

/// Reads what one layer (or the store) holds now.
pub type Gauge = Arc<dyn Fn() -> Memory + Send + Sync>;

/// The shared ledger of one seed.
#[derive(Clone, Default)]
pub struct Ledger {
    observed: Arc<Mutex<Observed>>,
    gauges: Arc<Mutex<Vec<Gauge>>>,
    /// Each client's attempt counter, kept across its restarts so that no two of its attempts
    /// share a tag.
    attempts: Arc<Mutex<BTreeMap<usize, Arc<std::sync::atomic::AtomicU64>>>>,
    /// What the clients' calls keep alive of their request bodies, and where.
    pub held: crate::held::Holdings,
    /// Each server's statistics, read at the end.
    stats: Arc<Mutex<BTreeMap<usize, StatsReader>>>,
}

impl fmt::Debug for Ledger {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ledger").finish_non_exhaustive()
    }
}

/// The simulation's clock: time since the simulation began, the same on every host.
pub fn now() -> Duration {
    turmoil::sim_elapsed().unwrap_or_default()
}

impl Ledger {
    /// The observations so far.
    pub fn lock(&self) -> MutexGuard<'_, Observed> {
        self.observed.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Client `client`'s attempt counter (the same one after a restart).
    pub fn attempt_counter(&self, client: usize) -> Arc<std::sync::atomic::AtomicU64> {
        self.attempts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(client)
            .or_default()
            .clone()
    }

    /// Sets how server `server`'s layer statistics are read (its latest boot's layer).
    pub fn stats_reader(&self, server: usize, reader: StatsReader) {
        self.stats
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(server, reader);
    }

    /// Whether every server's layer holds nothing now: no claim, no detached work, no waiter.
    pub fn layers_idle(&self) -> bool {
        let readers: Vec<StatsReader> = self
            .stats
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect();
        readers.into_iter().all(|r| {
            let s = r();
            s.in_flight == 0 && s.detached == 0 && s.waiting_bytes == 0
        })
    }

    /// Reads every server's layer statistics into the observations.
    pub fn read_final_stats(&self) {
        let readers: Vec<(usize, StatsReader)> = self
            .stats
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(s, r)| (*s, r.clone()))
            .collect();
        let stats = readers.into_iter().map(|(s, r)| (s, r())).collect();
        self.lock().final_stats = stats;
    }

    /// Notes that attempt `tag` belongs to call `call` (and whether that call's client had been
    /// told its key was in flight when it sent it).
    pub fn attempt_of_call(&self, tag: u64, call: usize) {
        let mut o = self.lock();
        o.attempt_calls.insert(tag, call);
        if o.calls_told_in_flight.contains(&call) {
            o.attempts_sent_knowing.insert(tag);
        }
    }

    /// Notes that the downstream tier received a write made by the handler run of upstream
    /// attempt `upstream`.
    pub fn down_received(&self, upstream: u64) {
        *self.lock().down_received.entry(upstream).or_default() += 1;
    }

    /// Notes that call `call` waited for its client's one connection, from `since` to now,
    /// while an answer of its own held it, unread.
    pub fn call_waited_on_itself(&self, call: usize, since: Duration) {
        self.lock()
            .waited_on_themselves
            .entry(call)
            .or_insert(since);
    }

    /// Notes that call `call`'s client received an answer saying its key was in flight.
    pub fn call_told_in_flight(&self, call: usize) {
        self.lock().calls_told_in_flight.insert(call);
    }

    /// Adds a holding to read after every step (a layer, when it is made; the store).
    pub fn gauge(&self, gauge: Gauge) {
        self.gauges
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(gauge);
    }

    /// Reads every holding, and keeps each kind's peak (each holding on its own: every
    /// bound is per layer or per store).
    pub fn sample(&self, at: Duration) {
        let gauges = self.gauges.lock().unwrap_or_else(|p| p.into_inner());
        let now = gauges.iter().fold(Memory::default(), |m, g| m.max(g()));
        drop(gauges);
        let uncounted = self.held.check(at);
        let mut observed = self.lock();
        observed.peaks = observed.peaks.max(now);
        if uncounted.is_some() && observed.uncounted_replay.is_none() {
            observed.uncounted_replay = uncounted;
        }
    }

    /// Adds a line to the trace (from a host: at the simulation's time).
    pub fn event(&self, what: impl Into<String>) {
        self.event_at(now(), what);
    }

    /// Adds a line to the trace at `at` (from the driver, outside every host).
    pub fn event_at(&self, at: Duration, what: impl Into<String>) {
        self.lock().trace.push((at, what.into()));
    }

    /// Counts an injected fault of `kind`.
    pub fn fault(&self, kind: &'static str) {
        *self.lock().faults.entry(kind).or_default() += 1;
    }

    /// Records a call's start; returns its index.
    pub fn call_started(&self, client: usize, scope: ScopeName, sent: &[u8]) -> usize {
        let start = now();
        let mut o = self.lock();
        o.calls.push(CallRecord {
            client,
            scope,
            sent: sent.to_vec(),
            start,
            took_service: None,
            head: None,
            end: None,
        });
        o.calls.len() - 1
    }

    /// A client's budget for `layer` granted a token (`1`) or was given one back (`-1`).
    pub fn budget_token(&self, layer: BudgetOf, n: i64) {
        *self.lock().budget_tokens.entry(layer).or_default() += n;
    }

    /// A retry layer handed on a request of call `call`: its serial number.
    pub fn handoff(&self, call: Option<usize>) -> u64 {
        let mut o = self.lock();
        if let Some(call) = call {
            *o.handoffs.entry(call).or_default() += 1;
        }
        o.handoff_serials += 1;
        o.handoff_serials
    }

    /// An attempt of the request handed on as `serial` reached the wire.
    pub fn attempt_of_handoff(&self, serial: u64) {
        *self.lock().handoff_attempts.entry(serial).or_default() += 1;
    }

    /// Records that call `i` took its service (its own clone, or the client's shared one).
    pub fn call_took_service(&self, i: usize) {
        self.lock().calls[i].took_service = Some(now());
    }

    /// Records that the layer answered call `i`.
    pub fn call_head(&self, i: usize) {
        let at = now();
        self.lock().calls[i].head = Some(at);
    }

    /// Records how call `i` ended.
    pub fn call_ended(&self, i: usize, ending: Ending) {
        let at = now();
        self.lock().calls[i].end = Some((at, ending));
    }

    /// Client `client` crashed at `at`: its calls in flight ended with it.
    pub fn client_crashed(&self, client: usize, at: Duration) {
        let mut o = self.lock();
        for c in o.calls.iter_mut().filter(|c| c.client == client) {
            if c.end.is_none() {
                c.end = Some((at, Ending::Crashed));
            }
        }
    }

    /// Whether `client`'s send `id` ended (it is not sent again after a restart).
    pub fn send_ended(&self, client: usize, id: SendId) -> bool {
        self.lock().sends_ended.contains(&(client, id))
    }

    /// Records that `client`'s send `id` ended.
    pub fn end_send(&self, client: usize, id: SendId) {
        self.lock().sends_ended.insert((client, id));
    }
}
