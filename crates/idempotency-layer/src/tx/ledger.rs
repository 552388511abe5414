//! What the layer and a handler's transactional completion share about one claim: how many times
//! the handler wrote the record in a transaction of its own, and which response each write
//! recorded. The layer reads it when the handler returns, to decide whether the record is
//! already stored (and the claim must be left alone) or whether it must find out.
//!
//! Store-independent: the PostgreSQL side (`TxCompletion`, feature `postgres`) writes here; the
//! layer only judges.

use std::sync::{Arc, Mutex, MutexGuard};

use http::Extensions;

use crate::config::Config;
use crate::store::{Fingerprint, IdempotencyStore, ScopeKey, Token};

/// The record writes one claim's handler made in its transactions.
#[derive(Debug)]
pub(crate) struct TxLedger {
    token: Token,
    state: Mutex<LedgerState>,
}

#[derive(Debug, Default)]
struct LedgerState {
    /// Writes that may have reached the database (counted before each is sent).
    writes: u64,
    /// The layer has judged: the handler returned, later writes are refused.
    judged: bool,
}

/// A response extension: this response is the one that write number `write` of claim `token`
/// recorded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RecordedInTx {
    token: Token,
    write: u64,
}

/// What the layer makes of the handler's response.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum TxOutcome {
    /// The handler wrote nothing in a transaction: the layer records (or releases) as usual.
    Unused,
    /// The response is the one the handler's last write recorded, returned after its commit: the
    /// record is stored, the claim is done.
    Committed,
    /// The handler wrote the record in a transaction, then returned something else (another
    /// response, an error, a panic): whether that transaction committed, only the store knows.
    InDoubt,
}

/// The handler returned after the layer had judged: too late to write the record.
#[derive(Debug)]
pub(crate) struct AlreadyJudged;

impl TxLedger {
    pub(crate) fn new(token: Token) -> Self {
        TxLedger {
            token,
            state: Mutex::default(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, LedgerState> {
        // Every critical section leaves the state consistent: a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Counts a write about to be sent; the marker its response will carry if it succeeds.
    pub(crate) fn start_write(&self) -> Result<RecordedInTx, AlreadyJudged> {
        let mut st = self.lock();
        if st.judged {
            return Err(AlreadyJudged);
        }
        st.writes += 1;
        Ok(RecordedInTx {
            token: self.token,
            write: st.writes,
        })
    }

    /// The handler returned with a response whose extensions are `extensions` (none for an
    /// error or a panic): judge it, once. The marker is taken out of the extensions.
    pub(crate) fn judge(&self, extensions: Option<&mut Extensions>) -> TxOutcome {
        let marker = extensions.and_then(|e| e.remove::<RecordedInTx>());
        let mut st = self.lock();
        st.judged = true;
        let last = RecordedInTx {
            token: self.token,
            write: st.writes,
        };
        match (st.writes, marker) {
            (0, _) => TxOutcome::Unused,
            (_, Some(m)) if m == last => TxOutcome::Committed,
            _ => TxOutcome::InDoubt,
        }
    }
}

/// What the claim a leader holds lets its handler do in a transaction of its own.
pub(crate) struct Offer<'a> {
    pub(crate) scope: ScopeKey,
    pub(crate) token: Token,
    pub(crate) fingerprint: Fingerprint,
    pub(crate) config: &'a Arc<Config>,
    /// The request's protocol is gRPC (it decides how the response is classified).
    pub(crate) grpc: bool,
}

/// Offers the handler transactional completion of the claim, as a request extension, when the
/// store can do it ([`IdempotencyStore::postgres`]: a `PostgresStore`, or a store that holds
/// one and says so); the ledger the layer judges the handler's response by. `None`: nothing
/// offered, the layer records as usual.
#[cfg_attr(not(feature = "postgres"), allow(unused_variables))]
pub(crate) fn offer<St: IdempotencyStore>(
    store: &St,
    extensions: &mut Extensions,
    offer: Offer<'_>,
) -> Option<Arc<TxLedger>> {
    #[cfg(feature = "postgres")]
    if let Some(pg) = store.postgres() {
        let ledger = Arc::new(TxLedger::new(offer.token));
        extensions.insert(super::TxCompletion::new(pg.clone(), offer, ledger.clone()));
        return Some(ledger);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn response_carrying(marker: RecordedInTx) -> Extensions {
        let mut e = Extensions::new();
        e.insert(marker);
        e
    }

    #[test]
    fn only_the_last_writes_response_counts_as_committed() {
        let ledger = TxLedger::new(Token(7));
        let first = ledger.start_write().unwrap();
        ledger.start_write().unwrap();
        // The first transaction's response is stale once a second write was sent.
        assert_eq!(
            ledger.judge(Some(&mut response_carrying(first))),
            TxOutcome::InDoubt
        );

        let ledger = TxLedger::new(Token(7));
        ledger.start_write().unwrap();
        let last = ledger.start_write().unwrap();
        let mut ext = response_carrying(last);
        assert_eq!(ledger.judge(Some(&mut ext)), TxOutcome::Committed);
        assert!(
            ext.get::<RecordedInTx>().is_none(),
            "the marker is taken out"
        );
        assert!(
            ledger.start_write().is_err(),
            "no write after the layer judged"
        );
    }

    #[test]
    fn no_write_is_unused_and_a_foreign_or_missing_marker_is_in_doubt() {
        let ledger = TxLedger::new(Token(1));
        assert_eq!(
            ledger.judge(Some(&mut Extensions::new())),
            TxOutcome::Unused
        );

        let ledger = TxLedger::new(Token(1));
        let other = TxLedger::new(Token(2)).start_write().unwrap();
        ledger.start_write().unwrap();
        assert_eq!(
            ledger.judge(Some(&mut response_carrying(other))),
            TxOutcome::InDoubt
        );

        let ledger = TxLedger::new(Token(1));
        ledger.start_write().unwrap();
        assert_eq!(
            ledger.judge(None),
            TxOutcome::InDoubt,
            "an error or a panic"
        );
    }
}
