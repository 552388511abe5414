//! The tokio half of the stranded request alone: a value sent on an unbounded channel while its receiver is
//! being dropped can stay in the channel, neither received nor dropped, until the last sender
//! goes. hyper's client dispatch sends each request this way (`Envelope`), and only the
//! envelope's drop answers a request its connection never took.
//!
//! ```text
//! cargo run --release --manifest-path repro/hyper-dispatch-race/Cargo.toml --bin mpsc -- 300000
//! ```

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};

use tokio::sync::{mpsc, oneshot};

/// Answers its waiter when dropped, as hyper's `Envelope` does ("connection closed").
struct Envelope(Option<oneshot::Sender<&'static str>>);

impl Drop for Envelope {
    fn drop(&mut self) {
        if let Some(tx) = self.0.take() {
            let _ = tx.send("connection closed");
        }
    }
}

fn main() {
    let iterations: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(300_000);
    // The main thread sends; a helper drops the receiver at about the same moment.
    let go = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicUsize::new(0));
    let slot: Arc<Mutex<Option<mpsc::UnboundedReceiver<Envelope>>>> = Arc::default();
    {
        let (go, done, slot) = (go.clone(), done.clone(), slot.clone());
        std::thread::spawn(move || {
            let mut seen = 0;
            loop {
                while go.load(SeqCst) == seen {
                    std::hint::spin_loop();
                }
                seen += 1;
                drop(slot.lock().unwrap().take());
                done.store(seen, SeqCst);
            }
        });
    }
    let (mut refused, mut answered, mut stranded) = (0usize, 0usize, 0usize);
    for i in 1..=iterations {
        let (tx, rx) = mpsc::unbounded_channel::<Envelope>();
        *slot.lock().unwrap() = Some(rx);
        let (answer_tx, mut answer) = oneshot::channel();
        go.store(i, SeqCst);
        for _ in 0..(i % 64) {
            std::hint::spin_loop();
        }
        let sent = tx.send(Envelope(Some(answer_tx)));
        while done.load(SeqCst) != i {
            std::hint::spin_loop();
        }
        match sent {
            Err(_) => refused += 1,
            Ok(()) => match answer.try_recv() {
                Ok(_) => answered += 1,
                Err(oneshot::error::TryRecvError::Empty) => {
                    stranded += 1;
                    drop(tx);
                    assert!(
                        answer.try_recv().is_ok(),
                        "answered once the last sender went"
                    );
                }
                Err(e) => panic!("{e:?}"),
            },
        }
    }
    println!(
        "{iterations} sends racing the receiver's drop: refused {refused}, dropped (answered) by the receiver's drop {answered}, left in the channel until the last sender went {stranded}"
    );
}
