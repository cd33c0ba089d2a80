//! The lease backend's `LISTEN` connections: an elector's own (see
//! `LeaseOptions::listen_via`) and a shared client's
//! ([`SharedLease::listen_via`]), and the early acquires that a release
//! announcement heard on them brings, within the wake-up limit.

use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError, Weak};

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use std::future::Future;
use std::pin::Pin;

use crate::conn::{ConnectOptions, DedicatedConnection, Notice};
use crate::election::config_error::ConfigError;
use crate::error::{Error, Result};

use crate::election::support::{listen_for, Park, Prepare, WakeLimit};
use crate::election::watch::{parse_leader_event, LEADER_CHANNEL, RESIGN_CHANNEL};
use crate::election::ElectorState;

use super::{Inner, SharedLease};

impl SharedLease {
    /// Listens on a connection that bypasses the pooler (directly to
    /// PostgreSQL, or through a session-mode pool) for the releases that
    /// leaders announce: a release of a role that one of this client's
    /// standbys waits for brings the next batched acquire forward, so a
    /// voluntary release is taken over in milliseconds instead of within
    /// `retry_every`. One connection for all the client's candidates, used
    /// to `LISTEN` (through a pooler in transaction mode `LISTEN` does not
    /// work) and, when it may call the schema's lease functions, for the
    /// releases and for the acquires that a release announcement brings
    /// (a planned handover then skips the pooler's hop); losing it never
    /// affects leadership, and it is reopened with backoff. Anyone who can connect may `NOTIFY`: a flood of
    /// announcements costs at most ten acquires a second.
    ///
    /// Refused for another schema than the client's.
    ///
    /// ```no_run
    /// # fn example() -> pgelect::Result<()> {
    /// use pgelect::{ConnectOptions, election::SharedLease};
    /// let pooled = ConnectOptions::from_url("postgres://app@pgbouncer:6432/app")?;
    /// let direct = ConnectOptions::from_url("postgres://app@db:5432/app")?;
    /// let client = SharedLease::new(&pooled).listen_via(direct)?;
    /// # let _ = client;
    /// # Ok(()) }
    /// ```
    pub fn listen_via(self, options: ConnectOptions) -> Result<SharedLease> {
        if options.schema_name() != self.inner.options.schema_name() {
            return Err(Error::Config(ConfigError::ListenSchemaMismatch {
                listen: options.schema_name().as_str().to_owned(),
                elector: self.inner.options.schema_name().as_str().to_owned(),
            }));
        }
        *self
            .inner
            .listen_via
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(options);
        self.through_pooler();
        if self.inner.started.load(Ordering::Acquire) {
            self.start_listening();
        }
        Ok(self)
    }

    /// Starts the listening task, once, if the client listens.
    pub(super) fn start_listening(&self) {
        let options = self
            .inner
            .listen_via
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let Some(options) = options else {
            return;
        };
        if self.inner.listening.swap(true, Ordering::AcqRel) {
            return;
        }
        let purpose = format!("{}-listen", self.purpose());
        tokio::spawn(listen_releases(
            Arc::downgrade(&self.inner),
            options,
            purpose,
            self.inner.stop.clone(),
        ));
    }
}

/// The `LISTEN` connection of a lease-backend elector (see
/// `LeaseOptions::listen_via`): forwards notifications on
/// [`LEADER_CHANNEL`] and [`RESIGN_CHANNEL`] to the elector's broadcast
/// channel; reconnects with backoff; ends when the elector is dropped.
pub(crate) async fn listen(
    shared: Weak<ElectorState>,
    options: ConnectOptions,
    stop: CancellationToken,
) {
    let (purpose, client) = match shared.upgrade() {
        Some(s) => (
            format!("listen:{}:{}", s.role, s.node),
            s.lease().map(|l| Arc::downgrade(&l.client.client().inner)),
        ),
        None => return,
    };
    // Parked on the candidate's lease client between notifications: its
    // release and the acquires a release brings go on it (see
    // `SharedLease::exec_direct`).
    let slot = client
        .as_ref()
        .and_then(Weak::upgrade)
        .map(|i| i.direct.clone());
    let prepare = ReadyDirect(client);
    let park = slot.as_deref().map(|slot| Park {
        slot,
        prepare: &prepare,
    });
    let channels = [LEADER_CHANNEL, RESIGN_CHANNEL];
    listen_for(&options, &purpose, &channels, &stop, park, |n| {
        let Some(s) = shared.upgrade() else {
            return false;
        };
        // A release sent before the LISTEN took effect (the first one, or
        // after a reconnection), or missed, was not heard: a standby that
        // found the lease held would sleep until its next retry. Wake it
        // as if it had been heard; it reads the row again (a hint like any
        // other, within the wake-up limit).
        let announced = n.is_some();
        let n = n.unwrap_or_else(|| Notice {
            channel: LEADER_CHANNEL.to_owned(),
            payload: format!("{}:released:{}", s.options.schema_name().as_str(), s.role),
        });
        if let Some(lease) = s.lease() {
            // The role's standby is woken from here, on the thread that
            // read the announcement, rather than by the campaign once the
            // broadcast reaches it (another task, often another thread):
            // a planned handover's successor sends its acquire sooner.
            let schema = s.options.schema_name().as_str();
            if n.channel == LEADER_CHANNEL
                && parse_leader_event(schema, &n.payload) == Some(("released", s.role.as_str()))
            {
                lease
                    .client
                    .client()
                    .wake_standbys(Some(&s.role), announced);
            }
            let _ = lease.notices.send(n);
        }
        true
    })
    .await
}

/// The listening task of [`SharedLease::listen_via`]: `LISTEN`s for
/// leader events and brings the standbys' next acquire forward when a
/// role one of them waits for is announced released; ends with the client.
pub(super) async fn listen_releases(
    inner: Weak<Inner>,
    options: ConnectOptions,
    purpose: String,
    stop: CancellationToken,
) {
    let schema = options.schema_name().as_str().to_owned();
    let wake = |role: Option<&str>| match inner.upgrade() {
        Some(i) => {
            SharedLease { inner: i }.wake_standbys(role, role.is_some());
            true
        }
        None => false,
    };
    let Some(slot) = inner.upgrade().map(|i| i.direct.clone()) else {
        return;
    };
    let prepare = ReadyDirect(Some(inner.clone()));
    let park = Park {
        slot: &slot,
        prepare: &prepare,
    };
    listen_for(
        &options,
        &purpose,
        &[LEADER_CHANNEL],
        &stop,
        Some(park),
        |n| match n {
            // Missed (before the LISTEN took effect, or the notices lagged):
            // poll as if one was ours.
            None => wake(None),
            Some(n) => match parse_leader_event(&schema, &n.payload) {
                Some(("released", role)) if n.channel == LEADER_CHANNEL => {
                    let alive = wake(Some(role));
                    if let Some(i) = inner.upgrade() {
                        i.releases_heard.fetch_add(1, Ordering::Relaxed);
                    }
                    alive
                }
                _ => inner.strong_count() > 0,
            },
        },
    )
    .await
}

/// [`SharedLease::ready_direct`] for the client (if it still lives) on
/// each new listening connection.
struct ReadyDirect(Option<Weak<Inner>>);

impl Prepare for ReadyDirect {
    fn prepare<'c>(
        &'c self,
        c: &'c DedicatedConnection,
    ) -> Pin<Box<dyn Future<Output = ()> + Send + 'c>> {
        Box::pin(async move {
            if let Some(inner) = self.0.as_ref().and_then(Weak::upgrade) {
                SharedLease { inner }.ready_direct(c).await;
            }
        })
    }
}

/// Early acquires brought by release announcements, within the wake-up
/// limit.
#[derive(Default)]
pub(super) struct Wakes {
    limit: WakeLimit,
    /// The early acquire already scheduled: it tries every standby, so
    /// announcements until then need no other.
    pending: Option<Instant>,
}

impl SharedLease {
    /// Brings the next acquire forward for the standby of `role` (for any
    /// standby when `None`: announcements may have been missed), if there
    /// is one, within the wake-up limit: its role was announced released
    /// (`announced`: heard so, not only possibly missed).
    pub(super) fn wake_standbys(&self, role: Option<&str>, announced: bool) {
        let inner = &self.inner;
        let now = Instant::now();
        {
            let mut wakes = inner.wakes.lock().unwrap_or_else(PoisonError::into_inner);
            let mut standbys = inner.standbys();
            // Marked in every case: an acquire in flight now may have read
            // the row before the release, and its outcome would put the
            // next try off by up to `retry_every`.
            match role {
                Some(r) => {
                    if let Some(s) = standbys.get_mut(r) {
                        s.woken_at = Some(now);
                        s.announced |= announced;
                    }
                }
                None => standbys.values_mut().for_each(|s| s.woken_at = Some(now)),
            }
            if wakes.pending.is_some_and(|p| p > now) {
                return;
            }
            let standby = match role {
                Some(r) => standbys.get_mut(r),
                None => standbys.values_mut().min_by_key(|s| s.due),
            };
            let Some(standby) = standby else {
                return;
            };
            if standby.due <= now {
                return;
            }
            let at = wakes.limit.reserve(now);
            wakes.pending = Some(at);
            standby.due = standby.due.min(at);
        }
        inner.joined.notify_one();
    }
}
