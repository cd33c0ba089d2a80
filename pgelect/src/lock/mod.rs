//! Advisory locks: session-scoped on dedicated connections, and
//! transaction-scoped on the caller's transaction.
