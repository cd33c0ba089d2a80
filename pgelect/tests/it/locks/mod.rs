//! Advisory locks: keys, session locks, transaction locks and semaphores.

mod keys;
mod semaphore;
mod session;
mod transaction;
