//! The store links of a chaos run, each through a [`FaultProxy`], suffering the faults of
//! [`LinkFault::ALL`] in turn on a schedule: what the soak and the failover runs share.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use test_support::fault_proxy::{FaultProxy, LinkFault};
use tokio::task::JoinHandle;

/// Fault proxies in front of a store's servers, and the schedule that faults them.
pub(crate) struct FaultedLinks {
    proxies: Arc<Vec<FaultProxy>>,
    inflicted: Arc<Mutex<Vec<usize>>>,
    schedule: Option<JoinHandle<()>>,
}

impl FaultedLinks {
    /// A proxy in front of each of `upstreams` (`host:port`), relaying faithfully.
    pub(crate) async fn start(upstreams: &[String]) -> FaultedLinks {
        let mut proxies = Vec::new();
        for upstream in upstreams {
            proxies.push(FaultProxy::start(upstream).await);
        }
        FaultedLinks {
            proxies: Arc::new(proxies),
            inflicted: Arc::new(Mutex::new(vec![0; LinkFault::ALL.len()])),
            schedule: None,
        }
    }

    /// Where the proxy in front of `upstreams[i]` listens.
    pub(crate) fn addr(&self, i: usize) -> SocketAddr {
        self.proxies[i].addr()
    }

    /// From now on, a fault begins every `every` (the first after `every - lasting`): the
    /// links all suffer the next fault of [`LinkFault::ALL`], for `lasting` (a reset or a
    /// half-open acts at once).
    pub(crate) fn fault_every(&mut self, every: Duration, lasting: Duration) {
        let (proxies, inflicted) = (self.proxies.clone(), self.inflicted.clone());
        self.schedule = Some(tokio::spawn(async move {
            let first = tokio::time::Instant::now() + every.saturating_sub(lasting);
            let mut ticks = tokio::time::interval_at(first, every.max(Duration::from_millis(1)));
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            for i in (0..LinkFault::ALL.len()).cycle() {
                ticks.tick().await;
                inflicted.lock().unwrap()[i] += 1;
                let faults = proxies
                    .iter()
                    .map(|p| p.inflict(LinkFault::ALL[i], lasting));
                futures_util::future::join_all(faults).await;
            }
        }));
    }

    /// Ends the schedule and every fault in force; answers the faults inflicted, by kind.
    pub(crate) fn stop(&mut self) -> Vec<(LinkFault, usize)> {
        if let Some(s) = self.schedule.take() {
            s.abort();
        }
        for p in self.proxies.iter() {
            p.clear();
        }
        self.inflicted
            .lock()
            .unwrap()
            .iter()
            .enumerate()
            .filter(|(_, &n)| n > 0)
            .map(|(i, &n)| (LinkFault::ALL[i], n))
            .collect()
    }
}

impl Drop for FaultedLinks {
    fn drop(&mut self) {
        if let Some(s) = self.schedule.take() {
            s.abort();
        }
    }
}

/// "3 half-open, 2 held replies, ...": the faults of [`FaultedLinks::stop`] for a report.
pub(crate) fn describe(faults: &[(LinkFault, usize)]) -> String {
    faults
        .iter()
        .map(|(fault, n)| format!("{n} {}", fault.name()))
        .collect::<Vec<_>>()
        .join(", ")
}
