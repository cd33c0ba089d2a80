//! The `promote` fault: a primary with a streaming replica, the primary
//! killed and the replica promoted, again and again.
//!
//! It runs in a phase of its own, on a pair of servers of its own (the test
//! kit's [`ReplicaSet`](pgelect_testkit::ReplicaSet), replicating
//! asynchronously), because its candidates need a URL that names both
//! servers with `target_session_attrs=read-write`, and the first phase's
//! faults need a single-host URL (a proxy per supervisor) and one server to
//! restart.
//!
//! **Two fixed ports.** Before every promotion but the first, the dead
//! primary is replaced by a new replica of the promoted server
//! (`pg_basebackup`). The candidates' URL must reach it without being
//! rewritten, so each of the two server slots is a small TCP front of this
//! process ([`Front`]) on a port it holds for the whole phase, forwarding to
//! whichever server fills the slot. The alternative, starting the new
//! replica on the dead primary's own port, would leave that port free
//! between the death and the rebuild for any other process to take, and
//! would need the test kit to start a server on a given port. A front adds
//! no fault of its own: a dead server behind it refuses the front's
//! connection, which then closes the client's, and the client moves on to
//! the next host as it would after a refused connection.
//!
//! **The primary address.** A third front, on a port of its own, leads to
//! the primary alone: at the start the primary, and from the moment a
//! promotion is done (the promoted server accepts writes) the promoted
//! server, as a virtual IP, HAProxy with health checks or DNS would. The
//! lease backend's PgBouncer stands in front of it ([`pooler`]), since
//! PgBouncer cannot follow `target_session_attrs` itself. Between the
//! primary's death and the re-pointing, a connection to it is refused.
//!
//! [`pooler`]: super::pooler
//!
//! **Lost writes.** Replication is asynchronous, so a commit acknowledged
//! by the old primary just before its death may never reach the new one.
//! That is the database's promise, not pgelect's, so the checker must not
//! call it a violation, and must not excuse more than that either. Before
//! each promotion chaos notes the time, then waits until the replica has
//! received everything the primary had written by then
//! ([`Pair::prepare`]): a write acknowledged before that time must be on the
//! new primary (a lost one is a violation); one acknowledged between that
//! time and the primary's death may be missing and is counted apart
//! (`unreplicated_writes`). The window is a few milliseconds: the wait
//! plus the fault's injection.

use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::Arc;

use tokio::net::{TcpListener, TcpStream};

/// A TCP front on a fixed port of its own, forwarding every connection to
/// the server now in its slot (`127.0.0.1:upstream`).
#[cfg_attr(not(feature = "throwaway"), allow(dead_code))]
pub(super) struct Front {
    pub port: u16,
    upstream: Arc<AtomicU16>,
    task: tokio::task::JoinHandle<()>,
}

#[cfg_attr(not(feature = "throwaway"), allow(dead_code))]
impl Front {
    pub async fn start(upstream: u16) -> std::io::Result<Front> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let port = listener.local_addr()?.port();
        let upstream = Arc::new(AtomicU16::new(upstream));
        let to = upstream.clone();
        let task = tokio::spawn(async move {
            // Aborting the task drops the set: every pipe ends with it.
            let mut pipes = tokio::task::JoinSet::new();
            while let Ok((mut client, _)) = listener.accept().await {
                let port = to.load(Ordering::SeqCst);
                pipes.spawn(async move {
                    // Refused (the slot's server is dead): dropping the
                    // client's connection sends it to the next host.
                    let Ok(mut server) = TcpStream::connect(("127.0.0.1", port)).await else {
                        return;
                    };
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                });
                // Reap finished pipes so that a long run does not keep them.
                while pipes.try_join_next().is_some() {}
            }
        });
        Ok(Front {
            port,
            upstream,
            task,
        })
    }

    /// New connections go to `127.0.0.1:port` from now on.
    pub fn point(&self, port: u16) {
        self.upstream.store(port, Ordering::SeqCst);
    }
}

impl Drop for Front {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[cfg(feature = "throwaway")]
pub(super) use own::Pair;

#[cfg(feature = "throwaway")]
mod own {
    use std::time::Duration;

    use pgelect_testkit::{ReplicaSet, Replication, SUPERUSER};

    use super::Front;
    use crate::chaos::{fail, now_ns};
    use crate::exit::{self, Failure};

    /// A primary and an asynchronous streaming replica, each behind a
    /// [`Front`] of its own, and which front leads to the primary.
    pub(in crate::chaos) struct Pair {
        // Field order is drop order: the fronts go before the servers.
        fronts: [Front; 2],
        /// The primary address: the primary alone, re-pointed after each
        /// promotion.
        primary_address: Front,
        /// The slot (index into `fronts`) the primary is in.
        primary_slot: usize,
        /// Whether the replica was promoted and not replaced yet.
        promoted: bool,
        set: ReplicaSet,
        password: String,
    }

    impl Pair {
        /// Starts the two servers (the superuser's password random) and
        /// their fronts.
        pub async fn start() -> Result<Pair, Failure> {
            let password = crate::chaos::candidates::random_hex();
            let pw = password.clone();
            let set = tokio::task::spawn_blocking(move || {
                ReplicaSet::start_with_password(Replication::Async, &pw)
            })
            .await
            .map_err(fail)?
            .map_err(|e| {
                Failure::new(
                    exit::UNAVAILABLE,
                    format!("cannot start a primary with a streaming replica for promote: {e}"),
                )
            })?;
            let front = |port| async move {
                Front::start(port)
                    .await
                    .map_err(|e| fail(format!("cannot start a TCP front: {e}")))
            };
            let fronts = [
                front(set.primary().port()).await?,
                front(set.replica().port()).await?,
            ];
            let primary_address = front(set.primary().port()).await?;
            Ok(Pair {
                fronts,
                primary_address,
                primary_slot: 0,
                promoted: false,
                set,
                password,
            })
        }

        /// The candidates' URL: both fronts, the primary wherever it is.
        pub fn url(&self) -> String {
            format!(
                "postgres://{SUPERUSER}:{}@127.0.0.1:{},127.0.0.1:{}/postgres?target_session_attrs=read-write&connect_timeout=2",
                self.password, self.fronts[0].port, self.fronts[1].port
            )
        }

        /// The port of the primary address: whichever server is the
        /// primary (none between a primary's death and the end of its
        /// replica's promotion).
        pub fn primary_address(&self) -> u16 {
            self.primary_address.port
        }

        /// The superuser's password on both servers.
        pub fn password(&self) -> &str {
            &self.password
        }

        /// How the header line names it.
        pub fn describe(&self) -> String {
            format!(
                "a primary with an asynchronous streaming replica behind 127.0.0.1:{} and 127.0.0.1:{} (target_session_attrs=read-write)",
                self.fronts[0].port, self.fronts[1].port
            )
        }

        /// Waits until the replica has replayed all the primary wrote (the
        /// schema, the table), before any candidate starts.
        pub fn wait_replayed(&self) -> Result<(), Failure> {
            tokio::task::block_in_place(|| self.set.wait_replayed())
                .map_err(|e| fail(format!("the replica did not catch up: {e}")))
        }

        /// Readies the next promotion: after one, a new replica of the
        /// promoted server, in the dead primary's slot; then waits until the
        /// replica received all the primary had written. Returns the time
        /// (ns since the epoch) noted before that wait: every write
        /// acknowledged before it survives the promotion. Blocks this worker
        /// thread meanwhile.
        pub fn prepare(&mut self) -> Result<u128, Failure> {
            if self.promoted {
                let took = tokio::task::block_in_place(|| self.set.rebuild()).map_err(|e| {
                    Failure::new(
                        exit::UNAVAILABLE,
                        format!("cannot rebuild a replica of the promoted server: {e}"),
                    )
                })?;
                // The promoted server is in the other slot; the new replica
                // takes the dead primary's.
                self.fronts[self.primary_slot].point(self.set.replica().port());
                self.primary_slot = 1 - self.primary_slot;
                self.promoted = false;
                println!(
                    "  (a new replica of the primary, on 127.0.0.1:{} behind :{}, made in {} ms)",
                    self.set.replica().port(),
                    self.fronts[1 - self.primary_slot].port,
                    took.as_millis()
                );
            }
            let durable = now_ns();
            tokio::task::block_in_place(|| self.set.wait_received()).map_err(|e| {
                fail(format!(
                    "the replica did not receive the primary's WAL: {e}"
                ))
            })?;
            Ok(durable)
        }

        /// Kills the primary (`pg_ctl stop -m immediate`) and promotes the
        /// replica, then points the primary address at it; returns when
        /// the primary had died (ns since the epoch) and how long the
        /// promotion took from there until the new primary accepted a
        /// write. Blocks this worker thread meanwhile.
        pub fn promote(&mut self) -> Result<(u128, Duration), Failure> {
            let took = tokio::task::block_in_place(|| self.set.promote()).map_err(|e| {
                Failure::new(
                    exit::UNAVAILABLE,
                    format!("cannot promote the replica: {e}"),
                )
            })?;
            // As an HA proxy would, once the new primary takes writes.
            self.primary_address.point(self.set.replica().port());
            self.promoted = true;
            let died = now_ns().saturating_sub(took.as_nanos());
            Ok((died, took))
        }
    }
}

/// Without the throwaway server there is no pair: never built.
#[cfg(not(feature = "throwaway"))]
pub(super) enum Pair {}

#[cfg(not(feature = "throwaway"))]
impl Pair {
    pub async fn start() -> Result<Pair, crate::exit::Failure> {
        Err(super::fail("BUG: promote without the throwaway server"))
    }

    pub fn url(&self) -> String {
        match *self {}
    }

    pub fn describe(&self) -> String {
        match *self {}
    }

    pub fn primary_address(&self) -> u16 {
        match *self {}
    }

    pub fn password(&self) -> &str {
        match *self {}
    }

    pub fn wait_replayed(&self) -> Result<(), crate::exit::Failure> {
        match *self {}
    }

    pub fn prepare(&mut self) -> Result<u128, crate::exit::Failure> {
        match *self {}
    }

    pub fn promote(&mut self) -> Result<(u128, std::time::Duration), crate::exit::Failure> {
        match *self {}
    }
}
