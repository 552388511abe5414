//! The example's domain: books with stock, orders, and counters of real side effects.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// A book and its stock.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Book {
    /// The book's id (`b1`..`b5` in the demo inventory).
    pub book_id: String,
    /// The title.
    pub title: String,
    /// Copies in stock.
    pub stock: i64,
    /// Bumped by every change of the stock: a write that names the version it read
    /// ([`Inventory::deduct`]) is refused with a conflict when the stock changed since.
    pub version: u64,
}

/// What a deduction left.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
pub struct Deducted {
    /// Copies left.
    pub remaining: i64,
    /// The book's version after the deduction.
    pub version: u64,
}

/// A created order.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Order {
    /// A fresh UUID per executed order.
    pub order_id: String,
    /// The book ordered.
    pub book_id: String,
    /// How many copies.
    pub quantity: i32,
}

/// How many times each side effect really executed.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq, Default)]
pub struct Stats {
    /// Orders created.
    pub orders_created: i64,
    /// Stock deductions.
    pub deductions: i64,
}

/// Why a write was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InventoryError {
    /// No book with this id.
    NoSuchBook(String),
    /// Not enough stock: a failed precondition (HTTP 422, gRPC `FAILED_PRECONDITION`), which a
    /// retry does not change.
    NotEnoughStock {
        /// The book.
        book_id: String,
        /// What is left.
        stock: i64,
    },
    /// The book changed since the version the write was computed from: the `STOCK_CONFLICT`
    /// reason code (HTTP 409, gRPC `ABORTED`). Re-read the book, rebuild the write from what
    /// it says now, and send that (never the same write as it was).
    VersionConflict {
        /// The book.
        book_id: String,
        /// The version the write named.
        expected: u64,
        /// The book's version now.
        current: u64,
    },
    /// The quantity is below 1.
    BadQuantity(i64),
    /// The inventory service the stock comes from (`orders-server --inventory-url`) refused
    /// the deduction for a reason a retry does not change (HTTP 400 or 422): passed on.
    Refused {
        /// Its status.
        status: u16,
        /// What it said.
        detail: String,
    },
    /// The inventory service the stock comes from did not answer with a deduction or a
    /// refusal (down, overloaded, out of time): HTTP 503, the order did not run here and a
    /// retry runs it again.
    Unavailable(String),
}

impl std::fmt::Display for InventoryError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            InventoryError::NoSuchBook(id) => write!(f, "no book {id:?}"),
            InventoryError::NotEnoughStock { book_id, stock } => {
                write!(f, "not enough stock of {book_id}: {stock} left")
            }
            InventoryError::VersionConflict {
                book_id,
                expected,
                current,
            } => write!(
                f,
                "{book_id} changed: the write was computed from version {expected}, it is at \
                 version {current} now; re-read it and rebuild the write"
            ),
            InventoryError::BadQuantity(q) => write!(f, "quantity must be at least 1, got {q}"),
            InventoryError::Refused { status, detail } => {
                write!(f, "the inventory service refused ({status}): {detail}")
            }
            InventoryError::Unavailable(why) => write!(f, "{why}"),
        }
    }
}

impl std::error::Error for InventoryError {}

/// The shared inventory: cheap to clone.
#[derive(Debug, Clone)]
pub struct Inventory {
    books: Arc<Mutex<HashMap<String, Book>>>,
    orders_created: Arc<AtomicI64>,
    deductions: Arc<AtomicI64>,
    work: Duration,
}

impl Inventory {
    /// Books `b1`..`b5`, each with 1 000 000 copies; writes take `work` before they apply.
    pub fn seeded(work: Duration) -> Self {
        let titles = [
            "Designing Data-Intensive Applications",
            "Release It!",
            "Site Reliability Engineering",
            "Database Internals",
            "The Art of Multiprocessor Programming",
        ];
        let books = titles
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let id = format!("b{}", i + 1);
                let book = Book {
                    book_id: id.clone(),
                    title: (*t).to_owned(),
                    stock: 1_000_000,
                    version: 1,
                };
                (id, book)
            })
            .collect();
        Inventory {
            books: Arc::new(Mutex::new(books)),
            orders_created: Arc::default(),
            deductions: Arc::default(),
            work,
        }
    }

    /// Sets the stock of a book (for tests and demos of STOCK_CONFLICT).
    pub fn set_stock(&self, book_id: &str, stock: i64) {
        if let Some(b) = self.lock().get_mut(book_id) {
            b.stock = stock;
            b.version += 1;
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Book>> {
        self.books.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A book.
    pub fn book(&self, book_id: &str) -> Option<Book> {
        self.lock().get(book_id).cloned()
    }

    fn take(
        &self,
        book_id: &str,
        quantity: i64,
        expected_version: Option<u64>,
    ) -> Result<Deducted, InventoryError> {
        if quantity < 1 {
            return Err(InventoryError::BadQuantity(quantity));
        }
        let mut books = self.lock();
        let book = books
            .get_mut(book_id)
            .ok_or_else(|| InventoryError::NoSuchBook(book_id.to_owned()))?;
        if let Some(expected) = expected_version.filter(|v| *v != book.version) {
            return Err(InventoryError::VersionConflict {
                book_id: book_id.to_owned(),
                expected,
                current: book.version,
            });
        }
        if book.stock < quantity {
            return Err(InventoryError::NotEnoughStock {
                book_id: book_id.to_owned(),
                stock: book.stock,
            });
        }
        book.stock -= quantity;
        book.version += 1;
        Ok(Deducted {
            remaining: book.stock,
            version: book.version,
        })
    }

    /// Creates an order: the side effect an idempotency key must protect.
    pub async fn create_order(
        &self,
        book_id: &str,
        quantity: i64,
    ) -> Result<Order, InventoryError> {
        let order = self.reserve(book_id, quantity).await?;
        self.confirm(&order);
        Ok(order)
    }

    /// The first half of [`create_order`](Self::create_order), for orders kept elsewhere (a
    /// database): takes the stock and makes the order, not yet counted as created. Then
    /// [`confirm`](Self::confirm) it once it is stored, or [`cancel`](Self::cancel) it.
    pub async fn reserve(&self, book_id: &str, quantity: i64) -> Result<Order, InventoryError> {
        tokio::time::sleep(self.work).await;
        self.take(book_id, quantity, None)?;
        Ok(Order {
            order_id: uuid::Uuid::new_v4().to_string(),
            book_id: book_id.to_owned(),
            quantity: quantity as i32,
        })
    }

    /// Counts a [`reserve`](Self::reserve)d order as created.
    pub fn confirm(&self, _order: &Order) {
        self.orders_created.fetch_add(1, Ordering::SeqCst);
    }

    /// Puts a [`reserve`](Self::reserve)d order's stock back: it was never stored.
    pub fn cancel(&self, order: &Order) {
        self.put_back(&order.book_id, i64::from(order.quantity));
    }

    /// Puts `quantity` copies of `book_id` back: a deduction that was never stored.
    pub fn put_back(&self, book_id: &str, quantity: i64) {
        if let Some(b) = self.lock().get_mut(book_id) {
            b.stock += quantity;
            b.version += 1;
        }
    }

    /// Deducts stock, if the book is still at `expected_version` when one is given (the
    /// version the caller read: optimistic concurrency); returns what remains.
    pub async fn deduct(
        &self,
        book_id: &str,
        quantity: i64,
        expected_version: Option<u64>,
    ) -> Result<Deducted, InventoryError> {
        tokio::time::sleep(self.work).await;
        let deducted = self.take(book_id, quantity, expected_version)?;
        self.deductions.fetch_add(1, Ordering::SeqCst);
        Ok(deducted)
    }

    /// The side-effect counters.
    pub fn stats(&self) -> Stats {
        Stats {
            orders_created: self.orders_created.load(Ordering::SeqCst),
            deductions: self.deductions.load(Ordering::SeqCst),
        }
    }
}
