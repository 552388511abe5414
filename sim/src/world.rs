//! One seed's world: the store host, the server instances, the client hosts and the probe on
//! turmoil, driven step by step while the schedule's faults are applied at their times.

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Once};
use std::time::Duration;

use idempotency_layer::MemoryStore;
use tokio::sync::watch;

use crate::app::{run_server, PanicArm, Shared};
use crate::client::{run_client, run_probe, ReadyGate};
use crate::ledger::{Ledger, Memory, Observed, PanicRecord};
use crate::schedule::{Fault, Schedule};
use crate::store_host::{store_pair, Facts, Injector, StoreFacts, StoreRule, DOWNSTREAM};
use crate::tag::AttemptTags;

/// The simulation's tick: every timer fires on a multiple of it.
pub const TICK: Duration = Duration::from_millis(5);

/// The longest a seed may run in simulated time; a call still open then has hung.
pub const SIM_LIMIT: Duration = Duration::from_secs(1500);

thread_local! {
    static CURRENT: RefCell<Option<Ledger>> = const { RefCell::new(None) };
}

/// Installs (once) a panic hook that records panics in the ledger of the seed running on this
/// thread, and prints the others as usual.
fn hook_panics() {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let ledger = CURRENT.with(|c| c.borrow().clone());
            match ledger {
                Some(ledger) => {
                    let message = info
                        .payload()
                        .downcast_ref::<&str>()
                        .map(|s| (*s).to_owned())
                        .or_else(|| info.payload().downcast_ref::<String>().cloned())
                        .unwrap_or_default();
                    let location = info
                        .location()
                        .map(|l| format!("{}:{}", l.file(), l.line()))
                        .unwrap_or_default();
                    ledger.event(format!("panic at {location}: {message}"));
                    ledger.lock().panics.push(PanicRecord { location, message });
                }
                None => previous(info),
            }
        }));
    });
}

/// What a seed's run left: the schedule, what was observed, and whether the simulation itself
/// ended cleanly.
#[derive(Debug)]
pub struct Run {
    /// The schedule.
    pub schedule: Arc<Schedule>,
    /// What happened.
    pub observed: Observed,
    /// An error of the simulation itself (a host's software failed, the time limit).
    pub sim_error: Option<String>,
    /// What each attempt's `begin` calls answered.
    pub tags: AttemptTags,
    /// What the store did, as the store host recorded it.
    pub facts: StoreFacts,
    /// The store's own counts at the end (records kept without their body, evictions,
    /// refusals).
    pub store_stats: idempotency_layer::store::MemoryStats,
}

enum Action {
    Start(usize),
    Heal(usize),
}

/// Runs `schedule` to its end.
pub fn run(schedule: Schedule) -> Run {
    hook_panics();
    let schedule = Arc::new(schedule);
    let ledger = Ledger::default();
    CURRENT.with(|c| *c.borrow_mut() = Some(ledger.clone()));
    let tags = AttemptTags::default();
    let facts = Facts::default();
    let memory = match schedule.settings.bounds.store {
        Some((max_bytes, retention)) => MemoryStore::builder()
            .max_bytes(max_bytes)
            .min_retention(retention)
            .build()
            .expect("valid MemoryStore settings"),
        None => MemoryStore::new(),
    };
    let sim_error = drive(&schedule, &ledger, &tags, &facts, memory.clone());
    let store_stats = memory.stats();
    CURRENT.with(|c| *c.borrow_mut() = None);
    let observed = std::mem::take(&mut *ledger.lock());
    let facts = facts.lock().clone();
    Run {
        schedule,
        observed,
        sim_error,
        tags,
        facts,
        store_stats,
    }
}

fn drive(
    schedule: &Arc<Schedule>,
    ledger: &Ledger,
    tags: &AttemptTags,
    facts: &Facts,
    memory: MemoryStore,
) -> Option<String> {
    let s = &schedule.settings;
    let mut sim = turmoil::Builder::new()
        .rng_seed(schedule.seed)
        .simulation_duration(SIM_LIMIT)
        .tick_duration(TICK)
        .min_message_latency(Duration::from_millis(1))
        .max_message_latency(Duration::from_millis(20))
        .fail_rate(s.fail_rate)
        .repair_rate(1.0)
        .build();

    let held = memory.clone();
    ledger.gauge(Arc::new(move || Memory {
        store_bytes: held.stats().bytes as u64,
        ..Memory::default()
    }));
    let injector = Injector::default();
    let (store_host, link) = store_pair(memory, tags.clone(), facts.clone(), injector.clone());
    sim.host("store", move || store_host.clone().run());

    if s.chain {
        let boots = Arc::new(AtomicU32::new(0));
        let (ledger, link) = (ledger.clone(), link.for_server(DOWNSTREAM));
        sim.host(crate::chain::DOWN, move || {
            let boot = boots.fetch_add(1, Ordering::SeqCst);
            crate::chain::run_down(ledger.clone(), link.clone(), boot)
        });
    }
    let shared = Shared::new(schedule, ledger.clone());
    let drains: Vec<Arc<watch::Sender<u64>>> = (0..s.servers)
        .map(|_| Arc::new(watch::channel(0).0))
        .collect();
    let panics: Vec<PanicArm> = (0..s.servers).map(|_| PanicArm::default()).collect();
    for (server, drains) in drains.iter().enumerate() {
        let boots = Arc::new(AtomicU32::new(0));
        let (schedule, shared, link, drains, arm) = (
            schedule.clone(),
            shared.clone(),
            link.for_server(server),
            drains.clone(),
            panics[server].clone(),
        );
        sim.host(format!("server{server}"), move || {
            let boot = boots.fetch_add(1, Ordering::SeqCst);
            let (schedule, shared, link) = (schedule.clone(), shared.clone(), link.clone());
            let host = crate::app::ServerHost {
                server,
                boot,
                drains: drains.clone(),
                panics: arm.clone(),
            };
            run_server(schedule, shared, link, host)
        });
    }

    let gates: Vec<ReadyGate> = (0..s.clients).map(|_| ReadyGate::default()).collect();
    let finished: Vec<Arc<AtomicBool>> = (0..s.clients).map(|_| Arc::default()).collect();
    let watchdog = crate::invariants::call_bound(schedule)
        + crate::client::BODY_BOUND
        + Duration::from_secs(10);
    // Hosts, not turmoil clients, so that they can crash and restart: the probe, the one
    // turmoil client, ends the simulation once every one of them has finished.
    for (client, gate) in gates.iter().enumerate() {
        let (schedule, ledger, gate, finished) = (
            schedule.clone(),
            ledger.clone(),
            gate.clone(),
            finished[client].clone(),
        );
        sim.host(format!("client{client}"), move || {
            let (schedule, ledger, gate) = (schedule.clone(), ledger.clone(), gate.clone());
            run_client(schedule, ledger, client, gate, watchdog, finished.clone())
        });
    }
    let go = Arc::new(AtomicBool::new(false));
    sim.client(
        "probe",
        run_probe(schedule.clone(), ledger.clone(), go.clone()),
    );

    let hosts = Hosts {
        store: injector.clone(),
        schedule: schedule.clone(),
        gates: gates.clone(),
        drains,
        finished: finished.clone(),
        panics,
    };

    // The faults' starts and heals, in time order.
    let mut actions: Vec<(Duration, Action)> = Vec::new();
    for (i, t) in schedule.faults.iter().enumerate() {
        actions.push((t.at, Action::Start(i)));
        if let Some(heal) = t.heal {
            actions.push((heal, Action::Heal(i)));
        }
    }
    actions.sort_by_key(|(at, _)| *at);
    let mut actions = actions.into_iter().peekable();
    let mut active = vec![false; schedule.faults.len()];
    let mut probing = false;

    loop {
        let ended = match sim.step() {
            Ok(ended) => ended,
            Err(e) => return Some(e.to_string()),
        };
        ledger.sample(sim.elapsed());
        if ended {
            return None;
        }
        let now = sim.elapsed();
        while let Some((_, action)) = actions.next_if(|(at, _)| *at <= now) {
            if probing {
                continue;
            }
            match action {
                Action::Start(i) => {
                    active[i] = true;
                    apply(&mut sim, &hosts, ledger, i, schedule.faults[i].fault, true);
                }
                Action::Heal(i) => {
                    active[i] = false;
                    apply(&mut sim, &hosts, ledger, i, schedule.faults[i].fault, false);
                }
            }
        }
        if !probing && finished.iter().all(|f| f.load(Ordering::SeqCst)) {
            // Every call has ended: heal everything, then probe each server.
            probing = true;
            for (i, t) in schedule.faults.iter().enumerate() {
                if active[i] {
                    active[i] = false;
                    apply(&mut sim, &hosts, ledger, i, t.fault, false);
                }
            }
            // One-shot store rules whose calls never came are gone too.
            injector.heal_all();
            ledger.lock().probing_from = Some(now);
            sim.set_fail_rate(0.0);
            ledger.event_at(now, "all calls ended; faults healed; probing");
            ledger.lock().healed = true;
            go.store(true, Ordering::SeqCst);
        }
    }
}

fn inject(hosts: &Hosts, id: usize, fault: Fault) {
    if let Fault::Store {
        op,
        fault,
        server,
        intent,
        times,
    } = fault
    {
        let scope = intent.map(|i| {
            let intent = &hosts.schedule.intents[i];
            hosts.schedule.scope_key(intent.tenant, &intent.key)
        });
        hosts.store.inject(
            id,
            StoreRule {
                op,
                server,
                scope,
                fault,
                times,
            },
        );
    }
}

/// What the faults act on, besides the simulation's hosts and links.
struct Hosts {
    store: Injector,
    schedule: Arc<Schedule>,
    gates: Vec<ReadyGate>,
    /// Each server's drain requests.
    drains: Vec<Arc<watch::Sender<u64>>>,
    /// Whether each client has finished (every send ended).
    finished: Vec<Arc<AtomicBool>>,
    /// Each server's one-shot panic of its service under the layer.
    panics: Vec<PanicArm>,
}

fn apply(
    sim: &mut turmoil::Sim<'_>,
    hosts: &Hosts,
    ledger: &Ledger,
    id: usize,
    fault: Fault,
    start: bool,
) {
    let verb = if start { "start" } else { "heal" };
    ledger.event_at(sim.elapsed(), format!("fault {verb}: {fault:?}"));
    match fault {
        Fault::Partition { client, server } => {
            let (a, b) = (format!("client{client}"), format!("server{server}"));
            if start {
                ledger.fault("network: partition");
                sim.partition(a.as_str(), b.as_str());
            } else {
                sim.repair(a.as_str(), b.as_str());
            }
        }
        Fault::Hold { client, server } => {
            let (a, b) = (format!("client{client}"), format!("server{server}"));
            if start {
                ledger.fault("network: hold (half-open)");
                sim.hold(a.as_str(), b.as_str());
            } else {
                sim.release(a.as_str(), b.as_str());
            }
        }
        Fault::Crash { server } => {
            let name = format!("server{server}");
            if start {
                if sim.is_host_running(name.as_str()) {
                    ledger.fault("host: server crash");
                    sim.crash(name.as_str());
                    let at = sim.elapsed();
                    ledger.lock().crashes.entry(server).or_default().push(at);
                }
            } else if !sim.is_host_running(name.as_str()) {
                // A restart: the new boot does not drain (a drained server's software ends, and
                // a crash may find it ended already), so a drain still open ends here.
                let at = sim.elapsed();
                restarted(ledger, server, at);
                sim.bounce(name.as_str());
            }
        }
        Fault::Store {
            fault: f,
            server,
            intent,
            times,
            ..
        } => {
            use idempotency_layer::conformance::Fault as F;
            if start {
                ledger.fault(match f {
                    F::Fail => "store: error",
                    F::Corrupt => "store: corrupt entry",
                    F::Delay(_) => "store: delay (before the operation)",
                    F::DelayReply(_) => "store: late reply (after the operation ran)",
                    F::LoseReply => "store: lost reply",
                    F::Full => "store: full",
                    F::Hang => "store: hang",
                    F::HangAfter => "store: hang after the operation ran",
                    F::Ack => "store: acknowledges work it never did",
                    _ => "store: other",
                });
                if server.is_some() {
                    ledger.fault("store: a fault on one server's calls");
                }
                if intent.is_some() {
                    ledger.fault("store: a fault on one key");
                }
                if times.is_some() {
                    ledger.fault("store: a one-shot fault (the next few calls)");
                }
                inject(hosts, id, fault);
            } else {
                hosts.store.heal(id);
            }
        }
        Fault::NotReady { client } => {
            if start {
                ledger.fault("readiness: client service not ready");
                hosts.gates[client].close();
            } else {
                hosts.gates[client].open();
            }
        }
        Fault::ClientCrash { client } => {
            let name = format!("client{client}");
            let finished = hosts.finished[client].load(Ordering::SeqCst);
            if start {
                if !finished && sim.is_host_running(name.as_str()) {
                    ledger.fault("host: client crash");
                    sim.crash(name.as_str());
                    ledger.client_crashed(client, sim.elapsed());
                }
            } else if !finished && !sim.is_host_running(name.as_str()) {
                sim.bounce(name.as_str());
            }
        }
        Fault::OneWay {
            client,
            server,
            to_server,
        } => {
            let (c, sv) = (format!("client{client}"), format!("server{server}"));
            let (from, to) = if to_server { (c, sv) } else { (sv, c) };
            if start {
                ledger.fault(if to_server {
                    "network: one-way partition (client to server)"
                } else {
                    "network: one-way partition (server to client)"
                });
                sim.partition_oneway(from.as_str(), to.as_str());
            } else {
                sim.repair_oneway(from.as_str(), to.as_str());
            }
        }
        Fault::Downstream { server, hold } => {
            let a = format!("server{server}");
            let b = crate::chain::DOWN;
            match (start, hold) {
                (true, false) => {
                    ledger.fault("downstream: partition");
                    sim.partition(a.as_str(), b);
                }
                (true, true) => {
                    ledger.fault("downstream: hold (half-open)");
                    sim.hold(a.as_str(), b);
                }
                (false, false) => sim.repair(a.as_str(), b),
                (false, true) => sim.release(a.as_str(), b),
            }
        }
        Fault::ServicePanic { server, in_call } => {
            if start {
                ledger.fault(if in_call {
                    "user code: the service under the layer panics in call"
                } else {
                    "user code: the service under the layer panics in poll_ready"
                });
                hosts.panics[server].arm(in_call);
            } else {
                hosts.panics[server].disarm();
            }
        }
        Fault::Drain { server } => {
            let name = format!("server{server}");
            // A drain asked for in the step its server restarted would reach the boot being
            // replaced, not the new one (which subscribes to drains after it starts): none.
            let at = sim.elapsed();
            let just_restarted = ledger
                .lock()
                .restarts
                .get(&server)
                .and_then(|r| r.last())
                .is_some_and(|t| at.saturating_sub(*t) <= TICK);
            if start {
                if sim.is_host_running(name.as_str()) && !just_restarted {
                    ledger.fault("host: server drained (GOAWAY) and restarted");
                    hosts.drains[server].send_modify(|n| *n += 1);
                    let at = sim.elapsed();
                    ledger
                        .lock()
                        .drains
                        .entry(server)
                        .or_default()
                        .push((at, None));
                }
            } else {
                let at = sim.elapsed();
                // The restart ends every drain of the server still open (two drains may
                // overlap: the first heal restarts it).
                restarted(ledger, server, at);
                if sim.is_host_running(name.as_str()) {
                    // The drain did not end in time: the restart kills what is left.
                    let at = sim.elapsed();
                    ledger.lock().crashes.entry(server).or_default().push(at);
                }
                sim.bounce(name.as_str());
            }
        }
    }
}

/// Server `server` restarts at `at` (a new boot, which knows nothing of the last one's claims):
/// noted, and every drain of it still open ends (the new boot does not drain).
fn restarted(ledger: &Ledger, server: usize, at: Duration) {
    let mut o = ledger.lock();
    o.restarts.entry(server).or_default().push(at);
    for drain in o.drains.entry(server).or_default().iter_mut() {
        drain.1.get_or_insert(at);
    }
}
