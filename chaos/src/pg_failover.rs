//! PostgreSQL failover chaos: concurrent `begin` + `complete` through a [`PostgresStore`] on a
//! primary with one streaming standby (`.ci/postgres-replica.sh`), while the run forces
//! failovers: the primary stops (crashes, or shuts down cleanly) and the standby is promoted;
//! the old primary then comes back as a standby of the new one. At the end, every record a
//! `complete` acknowledged (`Ok`) is looked up on the final primary: a missing one is a record
//! the failover lost (its key would execute again). Run once with asynchronous replication
//! (PostgreSQL's default) and once with a synchronous standby (`--synchronous`:
//! `synchronous_standby_names = '*'`, `synchronous_commit = on`).
//!
//! `cargo run --release -p chaos --bin pg-failover -- --help`.

use std::fmt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idempotency_layer::PostgresStore;
use test_support::fault_proxy::{FaultProxy, LinkFault};

use crate::links::{describe, FaultedLinks};
use tokio::time::Instant;

use crate::failover::{
    lost_when, run_load, run_script, write_checks, write_lost_when, Load, Losses,
};

/// How the primary stops.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PgHow {
    /// An immediate shutdown (SIGQUIT to the postmaster: every process exits at once, no
    /// checkpoint, no last WAL sent), as a crash.
    Crash,
    /// A fast shutdown (SIGINT): the standby receives all WAL before the primary stops, as in a
    /// planned switchover.
    Switchover,
}

/// What to run.
#[derive(Clone, Debug)]
pub struct PgFailoverOptions {
    /// Both nodes, `target_session_attrs=read-write` (`.ci/postgres-replica.sh` prints it).
    pub url: String,
    /// The two nodes' ports on 127.0.0.1 (either may be the primary).
    pub ports: [u16; 2],
    /// Failovers to force.
    pub failovers: usize,
    /// How.
    pub how: PgHow,
    /// The standby's WAL receiver is stopped (SIGSTOP) this long before the primary stops, and
    /// resumed as it stops: the writes of that stretch reach the primary alone (0: none).
    pub cut_replica: Duration,
    /// The standby's replication link runs through a fault proxy, left half-open this long
    /// before the primary stops: nothing of that stretch reaches the standby, even from the
    /// socket buffers (0: no proxy). A primary killed during a standby stall.
    pub stall_replication: Duration,
    /// The store reaches both nodes through fault proxies, and every `store_faults` the links
    /// suffer the next fault of [`LinkFault::ALL`] in turn, for half that long (zero: direct).
    pub store_faults: Duration,
    /// A synchronous standby (`synchronous_standby_names = '*'`) rather than asynchronous
    /// replication.
    pub synchronous: bool,
    /// Load between two failovers.
    pub between: Duration,
    /// Concurrent tasks.
    pub concurrency: usize,
    /// At most this many begin + complete per second (0: as fast as they go).
    pub rate: f64,
    /// The store's timeout.
    pub timeout: Duration,
    /// The command that brings the old primary back as a standby (`.ci/postgres-replica.sh`).
    pub restore: PathBuf,
    /// Before the failovers, the standby's WAL receiver is stopped this long under load (0:
    /// not): with a synchronous standby every commit waits for it, and the run samples what
    /// that leaves on the primary ([`StandbyAway`]).
    pub standby_away: Duration,
}

/// What a standby away under load left on the primary, sampled every 500 ms.
#[derive(Clone, Debug, Default)]
pub struct StandbyAway {
    /// How long it was away.
    pub away: Duration,
    /// Samples taken.
    pub samples: u64,
    /// The most backends of the run's store at once (its pool, renewals and listener; cancels
    /// are not backends), and the most of them waiting for the standby.
    pub most_backends: i64,
    /// The most of them waiting for the standby (`wait_event = 'SyncRep'`).
    pub most_waiting: i64,
    /// Samples in which a new connection to the primary was refused or timed out.
    pub refused: u64,
    /// The store's backends still waiting for the standby, for longer than the store's
    /// timeout, once it was back for twice that timeout (-1: the primary did not answer).
    pub waiting_after: i64,
}

/// The most backends a store of the run may hold: its pool (16), as many abandoned
/// connections whose statements are being cancelled (each leaves the pool as it is abandoned,
/// and is closed once the cancel took), its renewal connections (2) and its listener (1).
const STORE_BACKENDS: i64 = 16 + 16 + 2 + 1;

/// The run's figures.
#[derive(Clone, Debug, Default)]
pub struct PgFailoverReport {
    /// Synchronous standby or asynchronous replication.
    pub synchronous: bool,
    /// The store's records.
    pub losses: Losses,
    /// Failovers forced, and how long each took from the primary's stop until the standby
    /// accepted writes.
    pub failovers: Vec<Duration>,
    /// The standby away under load, if asked for.
    pub standby_away: Option<StandbyAway>,
    /// How long the standby's replication link was left half-open before each stop.
    pub stalled: Duration,
    /// The faults the store's links suffered, by kind.
    pub store_faults: Vec<(LinkFault, usize)>,
}

impl PgFailoverReport {
    /// Failed checks: with a synchronous standby, a record acknowledged and then lost.
    pub fn problems(&self) -> Vec<String> {
        let mut p = Vec::new();
        if self.synchronous && self.losses.lost > 0 {
            p.push(format!(
                "{} records acknowledged with a synchronous standby were lost",
                self.losses.lost
            ));
        }
        if self.losses.acknowledged == 0 {
            p.push("no record was acknowledged".to_owned());
        }
        if let Some(a) = &self.standby_away {
            if a.refused > 0 {
                p.push(format!(
                    "the primary refused new connections in {} samples while the standby was away",
                    a.refused
                ));
            }
            if a.most_backends > STORE_BACKENDS {
                p.push(format!(
                    "the store held {} backends at once while the standby was away (at most \
                     {STORE_BACKENDS}: abandoned statements kept theirs)",
                    a.most_backends
                ));
            }
            if a.waiting_after != 0 {
                p.push(format!(
                    "{} backends still waited for the standby after it was back",
                    a.waiting_after
                ));
            }
        }
        p
    }
}

impl fmt::Display for PgFailoverReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let took: Vec<String> = self
            .failovers
            .iter()
            .map(|d| format!("{:.1}s", d.as_secs_f64()))
            .collect();
        writeln!(
            f,
            "replication: {}",
            if self.synchronous {
                "synchronous standby"
            } else {
                "asynchronous"
            }
        )?;
        writeln!(
            f,
            "failovers: {} (from the primary's stop until the standby took writes: {})",
            self.failovers.len(),
            took.join(", ")
        )?;
        if !self.stalled.is_zero() {
            writeln!(
                f,
                "the standby's replication link half-open for {:.1} s before each stop",
                self.stalled.as_secs_f64()
            )?;
        }
        if !self.store_faults.is_empty() {
            writeln!(f, "store link faults: {}", describe(&self.store_faults))?;
        }
        if let Some(a) = &self.standby_away {
            writeln!(
                f,
                "standby away {:.0} s under load ({} samples): the store's backends at most {} \
                 ({} waiting for the standby), new connections refused in {} samples, still \
                 waiting after it was back: {}",
                a.away.as_secs_f64(),
                a.samples,
                a.most_backends,
                a.most_waiting,
                a.refused,
                a.waiting_after
            )?;
        }
        let l = &self.losses;
        writeln!(
            f,
            "  acknowledged {:>7} (replayed only {})  lost {:>5}  errors {:>6}",
            l.acknowledged, l.replayed, l.lost, l.errors
        )?;
        write_lost_when(f, l, "primary stop")?;
        write_checks(f, &self.problems())
    }
}

/// A connection to the node on `port`, if it answers.
async fn node(port: u16) -> Option<tokio_postgres::Client> {
    let (client, conn) = tokio_postgres::connect(
        &format!("host=127.0.0.1 port={port} user=postgres dbname=postgres connect_timeout=2"),
        tokio_postgres::NoTls,
    )
    .await
    .ok()?;
    tokio::spawn(conn);
    Some(client)
}

/// The ports of the primary and of the standby.
async fn roles(opts: &PgFailoverOptions) -> (u16, u16) {
    for &port in &opts.ports {
        let Some(c) = node(port).await else { continue };
        if let Ok(row) = c.query_one("SELECT pg_is_in_recovery()", &[]).await {
            if !row.get::<_, bool>(0) {
                let other = opts.ports.into_iter().find(|&p| p != port).expect("two");
                return (port, other);
            }
        }
    }
    panic!("no primary on ports {:?}", opts.ports)
}

/// Names the standbys the primary on `port` waits for at commit (`''`: none).
async fn synchronous_standbys(port: u16, names: &str) {
    let c = node(port).await.expect("the primary answers");
    c.batch_execute(&format!(
        "ALTER SYSTEM SET synchronous_standby_names = '{names}'"
    ))
    .await
    .expect("ALTER SYSTEM");
    c.batch_execute("SELECT pg_reload_conf()")
        .await
        .expect("reload");
}

fn signal(pid: i32, sig: &str) {
    let _ = std::process::Command::new("kill")
        .args([sig, &pid.to_string()])
        .status();
}

/// Stops the primary, promotes the standby; answers when the primary was stopped and how long
/// from then until the standby accepted writes. Brings the old primary back as a standby
/// (`restore`).
async fn force_failover(opts: &PgFailoverOptions) -> (Instant, Duration) {
    let (primary, standby) = roles(opts).await;
    let p = node(primary).await.expect("the primary answers");
    let s = node(standby).await.expect("the standby answers");
    // The postmaster's pid: the first line of the data directory's lock file.
    let data: String = p
        .query_one("SHOW data_directory", &[])
        .await
        .expect("SHOW data_directory")
        .get(0);
    let postmaster: i32 = std::fs::read_to_string(format!("{data}/postmaster.pid"))
        .ok()
        .and_then(|t| t.lines().next()?.trim().parse().ok())
        .expect("the primary's postmaster.pid (run this on the machine of the nodes)");
    let receiver: Option<i32> = if opts.cut_replica.is_zero() {
        None
    } else {
        wal_receiver(&s).await
    };
    if let Some(pid) = receiver {
        signal(pid, "-STOP");
        tokio::time::sleep(opts.cut_replica).await;
    }
    // Kept until the standby is promoted: the stalled link must deliver nothing.
    let _stalled = if opts.stall_replication.is_zero() {
        None
    } else {
        let link = replication_through_proxy(primary, standby).await;
        link.half_open();
        tokio::time::sleep(opts.stall_replication).await;
        Some(link)
    };
    let stopped = Instant::now();
    signal(
        postmaster,
        match opts.how {
            PgHow::Crash => "-QUIT",
            PgHow::Switchover => "-INT",
        },
    );
    // Until the old primary is gone (a fast shutdown first sends the standby its last WAL).
    let give_up = Instant::now() + Duration::from_secs(120);
    while node(primary).await.is_some() {
        assert!(Instant::now() < give_up, "the primary did not stop");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    if let Some(pid) = receiver {
        signal(pid, "-CONT");
    }
    s.query_one("SELECT pg_promote(true, 60)", &[])
        .await
        .expect("pg_promote");
    if opts.synchronous {
        synchronous_standbys(standby, "*").await;
    }
    let took = stopped.elapsed();
    run_script(&opts.restore).await;
    (stopped, took)
}

/// Points the standby's WAL receiver at a fault proxy in front of the primary; answers the
/// proxy once the standby streams through it.
async fn replication_through_proxy(primary: u16, standby: u16) -> FaultProxy {
    let link = FaultProxy::start(&format!("127.0.0.1:{primary}")).await;
    let s = node(standby).await.expect("the standby answers");
    s.batch_execute(&format!(
        "ALTER SYSTEM SET primary_conninfo = \
         'host=127.0.0.1 port={} user=postgres application_name=n{standby}'",
        link.addr().port()
    ))
    .await
    .expect("ALTER SYSTEM SET primary_conninfo");
    s.batch_execute("SELECT pg_reload_conf()")
        .await
        .expect("reload");
    let give_up = Instant::now() + Duration::from_secs(60);
    loop {
        let through: Option<i32> = s
            .query_opt(
                "SELECT sender_port FROM pg_stat_wal_receiver WHERE status = 'streaming'",
                &[],
            )
            .await
            .ok()
            .flatten()
            .map(|r| r.get(0));
        if through == Some(i32::from(link.addr().port())) && streaming(primary).await {
            return link;
        }
        assert!(
            Instant::now() < give_up,
            "the standby did not stream through the proxy within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A standby streams from the primary on `port`, caught up (it flushed all the primary sent).
async fn streaming(port: u16) -> bool {
    let Some(c) = node(port).await else {
        return false;
    };
    c.query_one(
        "SELECT count(*) FROM pg_stat_replication \
         WHERE state = 'streaming' AND flush_lsn = sent_lsn",
        &[],
    )
    .await
    .is_ok_and(|r| r.get::<_, i64>(0) > 0)
}

/// The pid of the standby's WAL receiver, if it runs.
async fn wal_receiver(standby: &tokio_postgres::Client) -> Option<i32> {
    standby
        .query_opt("SELECT pid FROM pg_stat_wal_receiver", &[])
        .await
        .ok()
        .flatten()
        .map(|r| r.get(0))
}

/// Stops the standby's WAL receiver for `opts.standby_away` while the load runs, sampling the
/// primary every 500 ms: the store's backends (by `application_name`), those waiting for the
/// standby, and whether a new connection is accepted.
async fn standby_away(opts: &PgFailoverOptions, app: &str) -> StandbyAway {
    let (primary, standby) = roles(opts).await;
    let s = node(standby).await.expect("the standby answers");
    let receiver = wal_receiver(&s)
        .await
        .expect("the standby's WAL receiver runs");
    let sample = || async {
        let c = node(primary).await?;
        // Waiting longer than the store's timeout: a statement the store gave up on.
        let stuck_ms = opts.timeout.as_millis() as f64;
        let row = c
            .query_one(
                "SELECT count(*), count(*) FILTER (WHERE wait_event = 'SyncRep'), \
                   count(*) FILTER (WHERE wait_event = 'SyncRep' \
                     AND query_start < now() - $2 * interval '1 millisecond') \
                 FROM pg_stat_activity WHERE application_name = $1",
                &[&app, &stuck_ms],
            )
            .await
            .ok()?;
        Some((
            row.get::<_, i64>(0),
            row.get::<_, i64>(1),
            row.get::<_, i64>(2),
        ))
    };
    let mut report = StandbyAway {
        away: opts.standby_away,
        ..StandbyAway::default()
    };
    signal(receiver, "-STOP");
    let back = Instant::now() + opts.standby_away;
    while Instant::now() < back {
        tokio::time::sleep(Duration::from_millis(500)).await;
        report.samples += 1;
        match sample().await {
            Some((backends, waiting, _)) => {
                report.most_backends = report.most_backends.max(backends);
                report.most_waiting = report.most_waiting.max(waiting);
            }
            None => report.refused += 1,
        }
    }
    signal(receiver, "-CONT");
    // Until the standby streams again (a receiver stopped past `wal_sender_timeout` reconnects
    // first), then the store's statements in flight have twice its timeout to end.
    let give_up = Instant::now() + Duration::from_secs(120);
    while !streaming(primary).await && Instant::now() < give_up {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(opts.timeout * 2).await;
    report.waiting_after = sample().await.map_or(-1, |(_, _, stuck)| stuck);
    report
}

/// Runs it: load through the failovers, then the check on the final primary.
pub async fn run_pg_failover(opts: PgFailoverOptions) -> PgFailoverReport {
    run_script(&opts.restore).await;
    let (primary, _) = roles(&opts).await;
    synchronous_standbys(primary, if opts.synchronous { "*" } else { "" }).await;
    let table = format!("failover_{}", std::process::id());
    // The store's sessions carry a name of their own, to count their backends.
    let app = table.clone();
    let url = format!(
        "{}{}application_name={app}",
        opts.url,
        if opts.url.contains('?') { '&' } else { '?' }
    );
    // The store's links to both nodes, through fault proxies if asked.
    let mut links = None;
    let url = if opts.store_faults.is_zero() {
        url
    } else {
        let nodes: Vec<String> = opts
            .ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        let mut l = FaultedLinks::start(&nodes).await;
        let mut url = url;
        for (i, node) in nodes.iter().enumerate() {
            url = url.replacen(node, &l.addr(i).to_string(), 1);
        }
        l.fault_every(opts.store_faults, opts.store_faults / 2);
        links = Some(l);
        url
    };
    let store = PostgresStore::builder(&url)
        .table(table)
        .timeout(opts.timeout)
        .connect()
        .await
        .expect("connect");
    store.migrate().await.expect("migrate");

    let stop = Arc::new(AtomicBool::new(false));
    let (load, tasks): (Arc<Load>, _) = run_load(
        &store,
        "pg",
        opts.concurrency,
        stop.clone(),
        false,
        opts.rate,
    )
    .await;
    let away = if opts.standby_away.is_zero() {
        None
    } else {
        tokio::time::sleep(opts.between).await;
        Some(standby_away(&opts, &app).await)
    };
    let mut failovers = Vec::new();
    let mut forced = Vec::new();
    for _ in 0..opts.failovers {
        tokio::time::sleep(opts.between).await;
        let (stopped, took) = force_failover(&opts).await;
        forced.push(stopped);
        failovers.push(took);
    }
    tokio::time::sleep(opts.between).await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        let _ = t.await;
    }
    let store_faults = links.as_mut().map(FaultedLinks::stop).unwrap_or_default();

    let acknowledged = load.acknowledged.lock().unwrap().clone();
    let (client, conn) = tokio_postgres::connect(&opts.url, tokio_postgres::NoTls)
        .await
        .expect("the final primary answers");
    tokio::spawn(conn);
    let table = store.table();
    let recorded: std::collections::HashSet<Vec<u8>> = client
        .query(
            &format!("SELECT scope FROM {table} WHERE state = 'completed'"),
            &[],
        )
        .await
        .expect("read the records")
        .into_iter()
        .map(|r| r.get::<_, Vec<u8>>(0))
        .collect();
    let lost: Vec<Instant> = acknowledged
        .iter()
        .filter(|(scope, _)| !recorded.contains(&scope.0[..]))
        .map(|&(_, at)| at)
        .collect();
    let _ = client
        .batch_execute(&format!("DROP TABLE IF EXISTS {table}"))
        .await;
    let (primary, _) = roles(&opts).await;
    synchronous_standbys(primary, "").await;
    PgFailoverReport {
        synchronous: opts.synchronous,
        losses: Losses {
            acknowledged: acknowledged.len() as u64,
            replayed: load.replayed.load(Ordering::Relaxed),
            lost: lost.len() as u64,
            errors: load.errors.load(Ordering::Relaxed),
            switches: 0,
            lost_when: lost_when(&lost, &forced),
        },
        failovers,
        standby_away: away,
        stalled: opts.stall_replication,
        store_faults,
    }
}
