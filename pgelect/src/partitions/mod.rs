//! Balanced partitions: a group of N partitions spread over the live
//! members of a fleet, each partition led by exactly one member with its
//! own fencing term.
//! (The book: [balanced partitions](../../../book/guide/partitions.html).)
//!
//! Partition `p` of group `G` is an ordinary role, `G/p`: it has its own
//! row in `pgelect.leaders`, its own term, and works with
//! `pgelect.fence('G/p', term)` and [`HeldPartition`]'s fence ([`LeaderContext::fence`]), `pgelect
//! status --role G/p` and [`request_resign`](crate::admin::request_resign).
//! A member is one shared client whatever N, on either backend:
//!
//! * **session backend** (the default): polling standbys
//!   ([`StandbyMode::Polling`](crate::election::StandbyMode::Polling)) on
//!   one [`SharedConnection`]; two
//!   connections, the shared lock connection and one that reads the group
//!   and listens for its releases;
//! * **lease backend** (`.elector(|b| b.backend(Backend::Lease))`): one
//!   [`SharedLease`] client, whose batched statements serve every
//!   partition and which also reads the group: one connection, which
//!   works through PgBouncer in transaction mode, so a fleet of members
//!   costs the server only the pooler's connections, and the pooler one
//!   login per member. Standbys look
//!   at the lease every `poll_interval`, and at once on a release with
//!   [`listen_via`](PartitionGroupBuilder::listen_via) (a direct
//!   connection that can `LISTEN`).
//!
//! # How the partitions are spread
//!
//! Every member rebalances on its own, from a view of the group's leader
//! rows and its live members that the members share (kept in
//! `<schema>.group_views`: computed again by one member when it is 250 ms
//! old, taken by the others, never acted on when over a second old): every `rebalance_every` (1 s
//! by default) while it has work that the next reads decide (it is over
//! its share, or could stand for a partition it does not stand for yet,
//! or a read started, stopped or handed over something, or showed a member
//! missing); otherwise twice as long after each read, up to 4 ×
//! `rebalance_every`, or more in a group of more than 100,000 members ×
//! partitions, so that the fleet's quiet reads read at most 100,000 rows
//! per `rebalance_every` (10 s at 1,000 members of 1,000 partitions);
//! after a failed read twice as long each time, up to twice that; each
//! interval shortened at random by up to a quarter. It also reads at once
//! after a loss, after a gain that leaves it under its share, and on a
//! release `NOTIFY` of one of the group's roles:
//!
//! * **Live members** `M` are counted from what another database user
//!   cannot forge: nodes with a row in the candidate registry
//!   (`<schema>.candidates`, writable only by users with candidate grants)
//!   for one of the group's roles. On the session backend the row's
//!   registered backend must be alive as the server shows it, belong to
//!   the user that registered and have started before the registration (a
//!   recycled pid is not taken for it); on the lease backend (no server
//!   session to check) the row must have been seen within its TTL (a
//!   standby's looks refresh it every half TTL), or the node must hold a
//!   lease of the group that has not expired (`leaders`, as writable as
//!   the registry). A hostile user can neither inflate `M` (which would
//!   shrink the share and leave partitions unled) nor deflate it.
//! * The **share** is `s = ⌈N / M⌉`. A member stands for at most
//!   `s - held` partitions at a time: unled ones first (no holder, an
//!   expired lease, or a holder that is not a live member), then, of each
//!   member over its share, at most that member's excess; a rendezvous hash
//!   of (member, partition) makes members prefer different partitions. So a
//!   member is never granted more than its share as it reads it: `s`, or
//!   `s + 1` for members that held `⌈N/(M-1)⌉` when a member joins, until
//!   they hand over.
//! * A member over its share **hands over** its excess, only partitions for
//!   which a ready standby of another live member waits: it cancels the
//!   partition's token, waits for the application to drop the
//!   [`HeldPartition`] (at most `release_grace`), then resigns; the waiting
//!   standby, woken by the release `NOTIFY`, takes the partition at once
//!   with a new term. No standby waiting, it keeps the partition, so that a
//!   rebalance never leaves one unled.
//! * A member that **dies** (process killed, backend terminated) loses its
//!   registry rows' backend at once: the others see its partitions unled
//!   at their next read and take them over after the handover delay (an
//!   unclean loss: the old holder may still be alive for a moment). On the
//!   lease backend its partitions are unled when their leases expire (the
//!   TTL after its last renewal), and taken over then.
//! * Members **agree on N**: each declares its partition count in its
//!   registrations' meta (key `pgelect_partitions`); a member that finds
//!   live members registered before it declaring another count takes no
//!   part ([`PartitionEvent::Refused`]) until they are gone.
//! * A member that **leaves** ([`PartitionGroup::leave`]) hands every
//!   partition over cleanly: tokens cancelled, duties dropped, released
//!   with `NOTIFY`; the others read the group at once and take them without
//!   a handover delay.
//!
//! Why polling standbys and not blocking ones: a member standing for many
//! partitions would need a connection per blocking wait; and a share-aware
//! member must be able to stop standing at will, which a dropped poll does
//! at once.
//!
//! ```no_run
//! # async fn example() -> pgelect::Result<()> {
//! use pgelect::{ConnectOptions, partitions::PartitionEvent, partitions::PartitionGroup};
//! let options = ConnectOptions::from_url("postgres://app@db/app")?;
//! let group = PartitionGroup::builder(options, "orders", 12)
//!     .member("worker-1")
//!     .build()?;
//! let mut events = group.join()?;
//! while let Some(event) = events.recv().await {
//!     match event {
//!         PartitionEvent::Gained(held) => {
//!             tokio::spawn(async move {
//!                 // Work on partition held.partition() until the token is
//!                 // cancelled, then drop `held` to let the next one take it.
//!                 held.token().cancelled().await;
//!                 drop(held);
//!             });
//!         }
//!         PartitionEvent::Lost { partition, reason, .. } => {
//!             println!("partition {partition} lost: {reason}");
//!         }
//!         _ => {}
//!     }
//! }
//! # Ok(()) }
//! ```

mod driver;
mod plan;

use std::collections::BTreeMap;
use std::fmt;
use std::ops::Deref;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use crate::conn::{ConnectOptions, TcpTimeouts};
use crate::election::{
    Backend, ElectorBuilder, LeaderContext, SharedConnection, SharedLease, Term, MAX_ROLE_BYTES,
};
use crate::error::{Error, Result};
use crate::loss::LossReason;

/// The lease TTL of a partition's elector unless
/// [`PartitionGroupBuilder::elector`] sets another: 10 s (deadline 8 s,
/// heartbeat 667 ms; the rest derived by the standard profile).
pub const DEFAULT_TTL: Duration = Duration::from_secs(10);

/// The most partitions a group may have.
pub const MAX_PARTITIONS: u32 = 4096;

/// The role of partition `partition` of group `group`: `group/partition`.
///
/// ```
/// assert_eq!(pgelect::partitions::partition_role("orders", 7), "orders/7");
/// ```
pub fn partition_role(group: &str, partition: u32) -> String {
    format!("{group}/{partition}")
}

/// The statement that computes a group's view (`$1` the group's roles in
/// partition order, `$2` their count), for the plan test
/// (`election::plans`); not part of the API.
#[doc(hidden)]
pub fn group_read_sql(schema: &crate::schema::SchemaName) -> String {
    driver::view_sql(schema.as_str())
}

type Configure = Arc<dyn Fn(ElectorBuilder) -> ElectorBuilder + Send + Sync>;

/// Builds a [`PartitionGroup`]; see [`PartitionGroup::builder`].
#[must_use = "a builder does nothing until `build` is called"]
pub struct PartitionGroupBuilder {
    options: ConnectOptions,
    group: String,
    partitions: u32,
    member: Option<String>,
    poll_interval: Duration,
    rebalance_every: Duration,
    release_grace: Duration,
    tcp: TcpTimeouts,
    listen_via: Option<ConnectOptions>,
    configure: Option<Configure>,
}

impl PartitionGroupBuilder {
    /// This member's node id (the `holder` of the partitions it leads),
    /// unique in the fleet. Default: `partitions-<pid>-<random>`.
    pub fn member(mut self, id: &str) -> Self {
        self.member = Some(id.to_owned());
        self
    }

    /// How often a standby tries its partition's lock (it also tries at once
    /// on a release `NOTIFY`). Default: `1s`.
    pub fn poll_interval(mut self, every: Duration) -> Self {
        self.poll_interval = every;
        self
    }

    /// How often the member reads the group and rebalances while it has
    /// work that the next reads decide (also at once after a loss, after
    /// a gain that leaves it under its share, and on a release `NOTIFY` of
    /// the group); a member with nothing to do reads half as often after
    /// each read, down to once every 4 × `rebalance_every`, or less often
    /// in a group of more than 100,000 members × partitions (see the
    /// [module docs](crate::partitions)); failed reads back off. Default:
    /// `1s`.
    pub fn rebalance_every(mut self, every: Duration) -> Self {
        self.rebalance_every = every;
        self
    }

    /// How long a handover or [`leave`](PartitionGroup::leave) waits for the
    /// application to drop a [`HeldPartition`] whose token was cancelled
    /// before releasing it anyway. Default: `5s`.
    pub fn release_grace(mut self, grace: Duration) -> Self {
        self.release_grace = grace;
        self
    }

    /// TCP settings of the shared lock connection. Default:
    /// [`TcpTimeouts::default`].
    pub fn tcp_timeouts(mut self, tcp: TcpTimeouts) -> Self {
        self.tcp = tcp;
        self
    }

    /// Lease backend: where the member's shared lease client listens for
    /// release announcements ([`SharedLease::listen_via`]),
    /// a connection that can `LISTEN` (directly to PostgreSQL, not through
    /// a pooler in transaction mode): its standbys then try a released
    /// partition at once instead of at their next look. Without it they
    /// look every `poll_interval`. Refused by `build` for the session
    /// backend (which listens on its own connection) and for another
    /// schema than the group's.
    pub fn listen_via(mut self, options: ConnectOptions) -> Self {
        self.listen_via = Some(options);
        self
    }

    /// Adjusts every partition's [`ElectorBuilder`] (backend, timing,
    /// profile, meta). The group then sets the node id and the shared
    /// client, overriding those: on the session backend a
    /// [`SharedConnection`] with
    /// polling standbys, on the lease backend
    /// (`.elector(|b| b.backend(Backend::Lease))`) a
    /// [`SharedLease`] whose standbys look
    /// at the lease every `poll_interval`. Default: the elector's
    /// defaults with a `ttl` of [`DEFAULT_TTL`] (10 s: the local deadline
    /// must end before the default TCP timeouts of the shared connection
    /// let the server drop a silent client).
    pub fn elector(
        mut self,
        configure: impl Fn(ElectorBuilder) -> ElectorBuilder + Send + Sync + 'static,
    ) -> Self {
        self.configure = Some(Arc::new(configure));
        self
    }

    /// Validates and builds. Fails with [`Error::InvalidName`] for a group
    /// name that is empty, contains `/` or NUL, or whose longest partition
    /// role exceeds [`MAX_ROLE_BYTES`], or a bad member id; with
    /// [`Error::Config`] for 0 or more than [`MAX_PARTITIONS`] partitions,
    /// zero intervals, or an elector configuration that does not validate
    /// (checked on partition 0).
    ///
    /// ```
    /// let o = pgelect::ConnectOptions::from_url("postgres://app@db/app").unwrap();
    /// assert!(pgelect::partitions::PartitionGroup::builder(o.clone(), "orders", 0).build().is_err());
    /// assert!(pgelect::partitions::PartitionGroup::builder(o.clone(), "a/b", 4).build().is_err());
    /// let g = pgelect::partitions::PartitionGroup::builder(o, "orders", 12).member("w1").build().unwrap();
    /// assert_eq!((g.partitions(), g.member()), (12, "w1"));
    /// ```
    pub fn build(self) -> Result<PartitionGroup> {
        let invalid = |what: &'static str, name: &str, reason: String| Error::InvalidName {
            what,
            shown: format!("{:?}", name.chars().take(64).collect::<String>()),
            reason,
        };
        if self.group.is_empty() {
            return Err(invalid("group", &self.group, "it is empty".into()));
        }
        if self.group.contains(['/', '\0']) {
            return Err(invalid(
                "group",
                &self.group,
                "it contains '/' or NUL ('/' separates the group from the partition number)".into(),
            ));
        }
        if self.partitions == 0 || self.partitions > MAX_PARTITIONS {
            return Err(Error::config(format!(
                "a partition group needs 1 to {MAX_PARTITIONS} partitions, not {}",
                self.partitions
            )));
        }
        let longest = partition_role(&self.group, self.partitions - 1);
        if longest.len() > MAX_ROLE_BYTES {
            return Err(invalid(
                "group",
                &self.group,
                format!(
                    "its partition role {longest:?} is {} bytes long, the limit is {MAX_ROLE_BYTES}",
                    longest.len()
                ),
            ));
        }
        for (what, d) in [
            ("poll_interval", self.poll_interval),
            ("rebalance_every", self.rebalance_every),
        ] {
            if d.is_zero() {
                return Err(Error::config(format!("{what} must be positive")));
            }
        }
        let member = match self.member {
            Some(m) => m,
            None => format!(
                "partitions-{}-{:08x}",
                std::process::id(),
                rand::random::<u32>()
            ),
        };
        let mut config = Config {
            options: self.options,
            group: self.group,
            partitions: self.partitions,
            member,
            poll_interval: self.poll_interval,
            rebalance_every: self.rebalance_every,
            release_grace: self.release_grace,
            tcp: self.tcp,
            backend: Backend::Session,
            listen_via: self.listen_via,
            configure: self.configure,
        };
        config.backend = config.base_builder(0).chosen_backend();
        if config.listen_via.is_some() && config.backend == Backend::Session {
            return Err(Error::config(
                "listen_via is for partition groups on the lease backend; the session backend listens on its own connection",
            ));
        }
        // Checks the member id, the elector configuration and listen_via
        // once, here, rather than failing partition by partition later.
        config.elector_builder(0, &Carrier::new(&config)?).build()?;
        let config = Arc::new(config);
        Ok(PartitionGroup {
            config,
            running: Mutex::new(None),
            held: Arc::default(),
        })
    }
}

impl fmt::Debug for PartitionGroupBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PartitionGroupBuilder")
            .field("target", &self.options.target())
            .field("group", &self.group)
            .field("partitions", &self.partitions)
            .field("member", &self.member)
            .finish_non_exhaustive()
    }
}

pub(crate) struct Config {
    pub(crate) options: ConnectOptions,
    pub(crate) group: String,
    pub(crate) partitions: u32,
    pub(crate) member: String,
    pub(crate) poll_interval: Duration,
    pub(crate) rebalance_every: Duration,
    pub(crate) release_grace: Duration,
    pub(crate) tcp: TcpTimeouts,
    /// The backend the elector configuration chose.
    pub(crate) backend: Backend,
    pub(crate) listen_via: Option<ConnectOptions>,
    configure: Option<Configure>,
}

/// The member's one shared client, which every partition's elector uses:
/// the session backend's shared connection or the lease backend's shared
/// lease client.
pub(crate) enum Carrier {
    Session(SharedConnection),
    Lease(SharedLease),
}

impl Carrier {
    pub(crate) fn new(config: &Config) -> Result<Carrier> {
        Ok(match config.backend {
            Backend::Session => {
                Carrier::Session(SharedConnection::new(&config.options, config.tcp))
            }
            Backend::Lease => {
                let client = SharedLease::new(&config.options);
                Carrier::Lease(match &config.listen_via {
                    Some(o) => client.listen_via(o.clone())?,
                    None => client,
                })
            }
        })
    }
}

impl Config {
    pub(crate) fn role(&self, partition: u32) -> String {
        partition_role(&self.group, partition)
    }

    pub(crate) fn roles(&self) -> Vec<String> {
        (0..self.partitions).map(|p| self.role(p)).collect()
    }

    /// Partition `partition`'s elector as the group's user configured it.
    fn base_builder(&self, partition: u32) -> ElectorBuilder {
        // A TTL of 10 s by default, not the elector's 15 s: on a shared
        // connection the local deadline (ttl - margin) must end before the
        // server may declare a silent client gone (10 s with the default
        // TCP timeouts).
        let b =
            crate::Elector::builder(self.options.clone(), &self.role(partition)).ttl(DEFAULT_TTL);
        match &self.configure {
            Some(f) => f(b),
            None => b,
        }
    }

    pub(crate) fn elector_builder(&self, partition: u32, carrier: &Carrier) -> ElectorBuilder {
        // The partition count, declared in the registration's meta (the
        // user's meta object keeps its keys) for the members to compare.
        let b = self
            .base_builder(partition)
            .node_id(&self.member)
            .with_meta_key(driver::PARTITIONS_KEY, self.partitions.into());
        match carrier {
            Carrier::Session(c) => b.on_shared_connection(c, self.poll_interval),
            Carrier::Lease(c) => b.on_shared_lease(c, self.poll_interval),
        }
    }
}

/// A group of partitions this process may lead some of; see the
/// [module docs](crate::partitions) for how they are spread and an example.
///
/// Dropped without [`leave`](PartitionGroup::leave), the member stops at
/// once: its leaderships are dropped without release, and the other
/// members take its partitions over after the handover delay, as after a
/// crash.
pub struct PartitionGroup {
    config: Arc<Config>,
    running: Mutex<Option<Running>>,
    /// What the member leads, each with the token its loss cancels.
    held: Arc<Mutex<BTreeMap<u32, (Term, CancellationToken)>>>,
}

struct Running {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl PartitionGroup {
    /// A builder for group `group` of `partitions` partitions (numbered
    /// `0..partitions`). Every member of a group must use the same
    /// `partitions`.
    pub fn builder(options: ConnectOptions, group: &str, partitions: u32) -> PartitionGroupBuilder {
        PartitionGroupBuilder {
            options,
            group: group.to_owned(),
            partitions,
            member: None,
            poll_interval: Duration::from_secs(1),
            rebalance_every: Duration::from_secs(1),
            release_grace: Duration::from_secs(5),
            tcp: TcpTimeouts::default(),
            listen_via: None,
            configure: None,
        }
    }

    /// The group's name.
    pub fn group(&self) -> &str {
        &self.config.group
    }

    /// The number of partitions.
    pub fn partitions(&self) -> u32 {
        self.config.partitions
    }

    /// This member's node id.
    pub fn member(&self) -> &str {
        &self.config.member
    }

    /// Starts taking part: spawns the member's task (on the current Tokio
    /// runtime) and returns the stream of [`PartitionEvent`]s. Every gain
    /// is followed by exactly one loss of that partition and term (a loss
    /// may come before the receiver is read; events are never dropped: the
    /// channel is unbounded, at most two events per partition change).
    ///
    /// Fails with [`Error::Config`] when called twice or outside a Tokio
    /// runtime. Errors of the database (a missing schema, privileges) are
    /// logged and retried at every rebalancing.
    pub fn join(&self) -> Result<PartitionEvents> {
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| {
            Error::config("PartitionGroup::join must be called within a Tokio runtime")
        })?;
        let mut running = self.running.lock().unwrap_or_else(PoisonError::into_inner);
        if running.is_some() {
            return Err(Error::config(format!(
                "member {:?} already joined group {:?}",
                self.config.member, self.config.group
            )));
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let stop = CancellationToken::new();
        let task = runtime.spawn(driver::run(
            self.config.clone(),
            tx,
            self.held.clone(),
            stop.clone(),
        ));
        *running = Some(Running { stop, task });
        Ok(PartitionEvents { rx })
    }

    /// The partitions this member leads now, with their terms (those gained
    /// and not yet lost or handed over): a partition is left out from the
    /// moment its [`HeldPartition`]'s token is cancelled.
    pub fn held(&self) -> BTreeMap<u32, Term> {
        self.held
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .filter(|(_, (_, ended))| !ended.is_cancelled())
            .map(|(p, (term, _))| (*p, *term))
            .collect()
    }

    /// Leaves the group: stops standing, cancels every held partition's
    /// token (events `Lost` with [`LossReason::Shutdown`]), waits for the
    /// application to drop each [`HeldPartition`] (at most `release_grace`),
    /// releases them (the other members take them at once, no handover
    /// delay), and closes the member's connections. Returns once all of that
    /// is done; the events stream then ends. A no-op if not joined.
    ///
    /// # Cancel safety
    /// The leaving runs in the member's task and completes even if this
    /// future is dropped.
    pub async fn leave(&self) -> Result<()> {
        let running = self
            .running
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(r) = running {
            r.stop.cancel();
            r.task
                .await
                .map_err(|e| Error::config(format!("the partition member task failed: {e}")))?;
        }
        Ok(())
    }

    /// Who leads which partition of this group, and the live members, as
    /// the database shows it now (see [`partition_assignment`]).
    ///
    /// # Cancel safety
    /// Cancel safe: one statement on a connection of its own.
    pub async fn assignment(&self) -> Result<PartitionAssignment> {
        partition_assignment(
            &self.config.options,
            &self.config.group,
            self.config.partitions,
        )
        .await
    }
}

impl Drop for PartitionGroup {
    fn drop(&mut self) {
        // Dropped without leave: stop at once; leaderships are dropped
        // without release (the others see an unclean loss).
        if let Some(r) = self
            .running
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            r.task.abort();
        }
    }
}

impl fmt::Debug for PartitionGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PartitionGroup")
            .field("group", &self.config.group)
            .field("partitions", &self.config.partitions)
            .field("member", &self.config.member)
            .field("held", &self.held())
            .finish()
    }
}

/// The stream of a member's gains and losses; see [`PartitionGroup::join`].
#[derive(Debug)]
pub struct PartitionEvents {
    rx: mpsc::UnboundedReceiver<PartitionEvent>,
}

impl PartitionEvents {
    /// The next event; `None` once the member left (or its task ended).
    ///
    /// # Cancel safety
    /// Cancel safe: an event not returned stays in the channel.
    pub async fn recv(&mut self) -> Option<PartitionEvent> {
        self.rx.recv().await
    }

    /// The next event if one is waiting.
    pub fn try_recv(&mut self) -> Option<PartitionEvent> {
        self.rx.try_recv().ok()
    }
}

/// A change of what a member leads.
#[derive(Debug)]
#[non_exhaustive]
pub enum PartitionEvent {
    /// A partition was gained: act on it until its token is cancelled, then
    /// drop the [`HeldPartition`].
    Gained(HeldPartition),
    /// The member does not take part: members that joined the group
    /// earlier declare another number of partitions. It has stopped
    /// standing and handed over what it held (each with its `Lost`), and
    /// takes part again by itself once no such member is left. Sent once
    /// per conflict; also logged as an error.
    Refused {
        /// Who declares what, and what to do.
        reason: String,
    },
    /// A partition's leadership ended (its token is already cancelled).
    Lost {
        /// The partition.
        partition: u32,
        /// The term that ended.
        term: Term,
        /// Why: [`LossReason::HandedOver`] for a rebalancing handover,
        /// [`LossReason::Shutdown`] for [`PartitionGroup::leave`], else the
        /// elector's reason (connection lost, deadline, …).
        reason: LossReason,
    },
}

/// A partition this member leads, handed to the application with
/// [`PartitionEvent::Gained`]. Hold it while working on the partition:
/// after it is lost to a handover or `leave`, the partition is released
/// only once this is dropped (or after `release_grace`), so that the next
/// leader never overlaps the work.
///
/// It dereferences to the partition's [`LeaderContext`]: its
/// [role](LeaderContext::role) (`group/partition`, for `pgelect.fence`),
/// [term](LeaderContext::term), [fence](LeaderContext::fence) and the loss
/// API ([`lost`](LeaderContext::lost), [`token`](LeaderContext::token),
/// [`is_lost`](LeaderContext::is_lost), [`loss`](LeaderContext::loss);
/// documented in [`loss`](crate::loss)). A held partition is lost when its
/// leadership is, and also when it is handed over: then the reason is
/// planned ([`LossReason::HandedOver`], [`LossReason::Shutdown`]) and
/// leaves time to wind down (the partition is released once this handle
/// is dropped, at most `release_grace` later); any other reason means the
/// leadership is already gone: stop at once.
pub struct HeldPartition {
    partition: u32,
    /// The leadership's context, with a loss signal that a handover ends too.
    context: LeaderContext,
    _done: oneshot::Sender<()>,
}

impl HeldPartition {
    /// The partition number.
    pub fn partition(&self) -> u32 {
        self.partition
    }
}

impl Deref for HeldPartition {
    type Target = LeaderContext;

    fn deref(&self) -> &LeaderContext {
        &self.context
    }
}

impl fmt::Debug for HeldPartition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HeldPartition")
            .field("role", &self.role())
            .field("term", &self.term())
            .field("loss", &self.loss())
            .finish()
    }
}

/// Who leads which partition of a group; see [`partition_assignment`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct PartitionAssignment {
    /// The group.
    pub group: String,
    /// Live members (see the [module docs](crate::partitions)), sorted.
    pub members: Vec<String>,
    /// One entry per partition, in order.
    pub partitions: Vec<PartitionLeader>,
}

impl PartitionAssignment {
    /// The partitions each live member leads (members leading none
    /// included).
    pub fn by_member(&self) -> BTreeMap<String, Vec<u32>> {
        let mut m: BTreeMap<String, Vec<u32>> = self
            .members
            .iter()
            .map(|x| (x.clone(), Vec::new()))
            .collect();
        for (p, l) in self.partitions.iter().enumerate() {
            if let Some(h) = &l.holder {
                m.entry(h.clone()).or_default().push(p as u32);
            }
        }
        m
    }
}

/// One partition's leader in a [`PartitionAssignment`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct PartitionLeader {
    /// The partition's role (`group/partition`).
    pub role: String,
    /// The holder while its lease runs; `None` when unled.
    pub holder: Option<String>,
    /// The last term handed out (`None`: never led).
    pub term: Option<Term>,
}

/// Who leads which partition of group `group` (of `partitions`
/// partitions), and the group's live members, read with one statement on
/// a connection of its own. Needs the privileges of an observer (SELECT on
/// `leaders` and `candidates`).
///
/// ```no_run
/// # async fn example() -> pgelect::Result<()> {
/// let options = pgelect::ConnectOptions::from_url("postgres://app@db/app")?;
/// let a = pgelect::partitions::partition_assignment(&options, "orders", 12).await?;
/// for (member, partitions) in a.by_member() {
///     println!("{member}: {partitions:?}");
/// }
/// # Ok(()) }
/// ```
///
/// # Cancel safety
/// Cancel safe: dropping the future drops its connection.
pub async fn partition_assignment(
    options: &ConnectOptions,
    group: &str,
    partitions: u32,
) -> Result<PartitionAssignment> {
    if partitions == 0 || partitions > MAX_PARTITIONS || group.is_empty() || group.contains('/') {
        return Err(Error::config(format!(
            "not a partition group: {group:?} with {partitions} partitions (1 to {MAX_PARTITIONS}, no '/' in the name)"
        )));
    }
    let (client, conn) = options.connect_plain("pgelect:partitions:status").await?;
    let task = tokio::spawn(conn);
    let roles: Vec<String> = (0..partitions).map(|p| partition_role(group, p)).collect();
    let read = driver::read(&client, options.schema_name().as_str(), &roles).await;
    drop(client);
    let _ = task.await;
    let driver::Read { view, terms, .. } = read?;
    let mut members: Vec<String> = view.members().map(str::to_owned).collect();
    members.sort();
    Ok(PartitionAssignment {
        group: group.to_owned(),
        members,
        partitions: view
            .partitions
            .iter()
            .zip(roles)
            .zip(terms)
            .map(|((v, role), term)| PartitionLeader {
                role,
                holder: v.holder.map(|h| view.name(h).to_owned()),
                term,
            })
            .collect(),
    })
}
