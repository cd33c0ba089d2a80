//! The server's side of a step: messages sent and answered, backends that
//! end, lock queues, the statements served (session and lease backends),
//! and which holder a preemption ends.

use super::scenario::{Backend, Standby};
use super::state::{Backend_, ElectionModel, Envelope, Life, Msg, State};

impl ElectionModel {
    pub(super) fn send(&self, st: &mut State, proc: usize, to_server: bool, msg: Msg) {
        let pr = &st.procs[proc];
        let user_conn = matches!(msg, Msg::Write { .. });
        if pr.partitioned {
            return;
        }
        st.net.push(Envelope {
            to_server,
            proc: proc as u8,
            inc: pr.inc,
            user_conn,
            sent_at: st.now,
            msg,
        });
    }

    pub(super) fn reply(&self, st: &mut State, proc: u8, inc: u8, msg: Msg) {
        if st.procs[proc as usize].partitioned {
            return;
        }
        st.net.push(Envelope {
            to_server: false,
            proc,
            inc,
            user_conn: false,
            sent_at: st.now,
            msg,
        });
    }

    /// The server ends a backend: its locks go to the next waiters.
    pub(super) fn end_backend(&self, st: &mut State, proc: u8, inc: u8, goodbye: bool) {
        let Some(i) = st
            .backends
            .iter()
            .position(|b| b.proc == proc && b.inc == inc)
        else {
            return;
        };
        st.backends.remove(i);
        for role in 0..st.locks.len() {
            for watch in [false, true] {
                let l = st.locks[role].get_mut(watch);
                l.queue.retain(|&(p, n, _)| (p, n) != (proc, inc));
                if l.holder == Some((proc, inc)) {
                    self.unlock(st, role, watch);
                }
            }
        }
        if goodbye {
            self.reply(st, proc, inc, Msg::Goodbye);
        }
    }

    /// The holder of a role's lock (or its watch key) lets go: the first
    /// waiter is granted it, and its lock statement ends.
    pub(super) fn unlock(&self, st: &mut State, role: usize, watch: bool) {
        let l = st.locks[role].get_mut(watch);
        l.holder = None;
        if l.queue.is_empty() {
            return;
        }
        let (p, n, _) = l.queue.remove(0);
        l.holder = Some((p, n));
        self.touch(st, p, n);
        let role = role as u8;
        let msg = if watch {
            st.seen_watch_handoff = true;
            Msg::WatchGranted { role }
        } else {
            Msg::Granted { role }
        };
        self.reply(st, p, n, msg);
    }

    /// The session of backend `(p, n)` did something now (a statement
    /// began or ended): the idle clock of every lock it holds restarts.
    pub(super) fn touch(&self, st: &mut State, p: u8, n: u8) {
        let now = st.now;
        for l in st
            .locks
            .iter_mut()
            .flat_map(|l| [&mut l.role, &mut l.watch])
            .filter(|l| l.holder == Some((p, n)))
        {
            l.idle_since = now;
        }
    }

    pub(super) fn ensure_backend(&self, st: &mut State, proc: u8, inc: u8) {
        if !st.backend_alive(proc, inc) {
            st.backends.push(Backend_ {
                proc,
                inc,
                last_rx: st.now,
            });
        }
    }

    /// The server handles a client message (`goodbye`: whether a backend
    /// that a preemption statement ends says goodbye).
    pub(super) fn serve(&self, st: &mut State, e: Envelope, goodbye: bool) {
        let s = &self.s;
        let (p, n) = (e.proc, e.inc);
        if let Msg::Write { role, term } = e.msg {
            let role = role as usize;
            st.procs[p as usize].cands[role].writing = false;
            let row_term = st.rows[role].term;
            if row_term != term && !s.breaks.skip_fence {
                st.seen_fence_refusal = true;
                return;
            }
            st.seen_write = true;
            if term < row_term && st.broken.is_none() {
                st.broken = Some(format!(
                    "(b) a write of term {term} committed after term {row_term} began"
                ));
            }
            if term < st.committed[role] && st.broken.is_none() {
                st.broken = Some(format!(
                    "(b) a write of term {term} committed after one of term {}",
                    st.committed[role]
                ));
            }
            st.committed[role] = st.committed[role].max(term);
            return;
        }
        if s.backend == Backend::Lease {
            self.serve_lease(st, e);
            return;
        }
        // A session message on a backend the server ended is lost (the
        // worst case: no error comes back either).
        let is_new = st.started[p as usize] != Some(n);
        if !st.backend_alive(p, n) {
            if is_new && n == st.procs[p as usize].inc && e.msg != Msg::Close {
                st.started[p as usize] = Some(n);
                // A new connection: its backend starts.
                self.ensure_backend(st, p, n);
            } else {
                return;
            }
        }
        if let Some(b) = st.backends.iter_mut().find(|b| b.proc == p && b.inc == n) {
            b.last_rx = st.now;
        }
        // The session is busy: the idle clock of every lock it holds
        // restarts (a grant below sets it too).
        self.touch(st, p, n);
        match e.msg {
            Msg::Lock { role, .. } | Msg::Try { role } | Msg::WatchLock { role } => {
                let r = role as usize;
                let watch = matches!(e.msg, Msg::WatchLock { .. });
                let (granted, not_granted) = if watch {
                    (Msg::WatchGranted { role }, Msg::WatchNotGranted { role })
                } else {
                    (Msg::Granted { role }, Msg::NotGranted { role })
                };
                let now = st.now;
                let l = st.locks[r].get_mut(watch);
                let answer = if l.holder.is_none() {
                    l.holder = Some((p, n));
                    l.idle_since = now;
                    Some(granted)
                } else if l.holder == Some((p, n)) {
                    Some(granted)
                } else {
                    match e.msg {
                        Msg::Lock { slice, .. } => {
                            l.queue.push((p, n, now + slice));
                            None
                        }
                        Msg::WatchLock { .. } => {
                            l.queue.push((p, n, now + s.wait_slice()));
                            None
                        }
                        _ => Some(not_granted),
                    }
                };
                if let Some(m) = answer {
                    self.reply(st, p, n, m);
                }
            }
            Msg::WatchUnlock { role } => {
                let r = role as usize;
                // `pg_advisory_unlock` of a key not held answers false,
                // which the standby logs and goes on.
                if st.locks[r].watch.holder == Some((p, n)) {
                    self.unlock(st, r, true);
                }
                self.reply(st, p, n, Msg::WatchUnlocked { role });
            }
            Msg::Read { role } => {
                let row = &st.rows[role as usize];
                let vacant = row.holder.is_none() || row.lease_until < st.now;
                self.reply(st, p, n, Msg::Row { role, vacant });
            }
            Msg::Preempt { role } => {
                let r = role as usize;
                if let Some((q, m)) = self.zombie(st, r, (p, n)) {
                    if st.rows[r].holder != Some((q, m)) {
                        st.seen_idle_preempt = true;
                    }
                    self.end_backend(st, q, m, goodbye);
                }
                self.reply(st, p, n, Msg::Preempted { role });
            }
            Msg::Elect { role, sent } => {
                let r = role as usize;
                if st.locks[r].role.holder != Some((p, n)) {
                    return;
                }
                let row = &mut st.rows[r];
                row.term += 1;
                // A takeover is unclean while the previous holder's lease
                // runs: once it expired on the server's clock, that
                // leader's deadline (counted from a renewal sent before
                // the server set the expiry, less the drift margin) has
                // passed.
                let unclean = row.holder.is_some() && row.lease_until >= st.now;
                row.holder = Some((p, n));
                row.lease_until = st.now + s.ticks(s.timing.ttl);
                let term = row.term;
                self.reply(
                    st,
                    p,
                    n,
                    Msg::Elected {
                        role,
                        term,
                        unclean,
                        sent,
                    },
                );
            }
            Msg::Renew { role, term, sent } => {
                let r = role as usize;
                let row = &mut st.rows[r];
                if row.holder.map(|h| h.0) == Some(p) && row.term == term {
                    row.lease_until = st.now + s.ticks(s.timing.ttl);
                    self.reply(st, p, n, Msg::Renewed { role, sent });
                } else {
                    self.reply(st, p, n, Msg::NotOurs { role, sent });
                }
            }
            Msg::Heartbeat { role } => self.reply(st, p, n, Msg::Alive { role }),
            Msg::Release { role, term } => {
                let r = role as usize;
                let row = &mut st.rows[r];
                if row.holder.map(|h| h.0) == Some(p) && row.term == term {
                    row.holder = None;
                }
                if st.locks[r].role.holder == Some((p, n)) {
                    self.unlock(st, r, false);
                }
            }
            Msg::Unlock { role } => {
                let r = role as usize;
                if st.locks[r].role.holder == Some((p, n)) {
                    self.unlock(st, r, false);
                }
            }
            Msg::Close => self.end_backend(st, p, n, false),
            _ => unreachable!("BUG: a server-bound {:?}", e.msg),
        }
    }

    pub(super) fn serve_lease(&self, st: &mut State, e: Envelope) {
        let s = &self.s;
        let p = e.proc;
        match e.msg {
            Msg::Take { role, sent } => {
                let r = role as usize;
                let row = &mut st.rows[r];
                if row.holder.is_none() || row.lease_until < st.now {
                    row.term += 1;
                    row.holder = Some((p, 0));
                    row.lease_until = st.now + s.ticks(s.timing.ttl);
                    let term = row.term;
                    self.reply(
                        st,
                        p,
                        e.inc,
                        Msg::Elected {
                            role,
                            term,
                            unclean: false,
                            sent,
                        },
                    );
                } else {
                    self.reply(st, p, e.inc, Msg::Busy { role, sent });
                }
            }
            Msg::Renew { role, term, sent } => {
                let r = role as usize;
                let row = &mut st.rows[r];
                if row.holder.map(|h| h.0) == Some(p) && row.term == term {
                    row.lease_until = st.now + s.ticks(s.timing.ttl);
                    self.reply(st, p, e.inc, Msg::Renewed { role, sent });
                } else {
                    self.reply(st, p, e.inc, Msg::NotOurs { role, sent });
                }
            }
            Msg::Release { role, term } => {
                let row = &mut st.rows[role as usize];
                if row.holder.map(|h| h.0) == Some(p) && row.term == term {
                    row.holder = None;
                }
            }
            _ => unreachable!("BUG: a lease server got {:?}", e.msg),
        }
    }

    /// Whether backend `(p, n)` is in a lock statement (the wait for a
    /// lock or a watch key): its session is active, not idle.
    pub(super) fn busy(st: &State, p: u8, n: u8) -> bool {
        st.locks
            .iter()
            .flat_map(|l| [&l.role, &l.watch])
            .any(|l| l.queue.iter().any(|&(q, m, _)| (q, m) == (p, n)))
    }

    /// The holder of `role`'s lock that `preempt` run now on
    /// backend `by` terminates:
    ///
    /// * the lock holder that the row names, once its lease expired;
    /// * the lock holder that the row does not name while the row is
    ///   vacant (no holder, or an expired lease), once its session has
    ///   been idle for longer than the TTL (`state_change < now() -
    ///   ttl`): a candidate paused between its grant and its term.
    pub(super) fn zombie(&self, st: &State, role: usize, by: (u8, u8)) -> Option<(u8, u8)> {
        let s = &self.s;
        let lock = &st.locks[role].role;
        let (p, n) = lock.holder.filter(|&h| h != by)?;
        let row = &st.rows[role];
        let expired = row.lease_until < st.now;
        if row.holder == Some((p, n)) {
            return expired.then_some((p, n));
        }
        let vacant = row.holder.is_none() || expired;
        let idle = !Self::busy(st, p, n) && lock.idle_since + s.ticks(s.timing.ttl) < st.now;
        (vacant && idle && !s.breaks.no_idle_preempt).then_some((p, n))
    }

    /// The watch that a queued standby whose slice times out now ends
    /// (`queue_slice_sql`): the watch key's holder, if its session has
    /// been idle for longer than the TTL on the server's clock. A healthy
    /// watch is idle only between two of its statements.
    pub(super) fn idle_watch(&self, st: &State, role: usize) -> Option<(u8, u8)> {
        let s = &self.s;
        let lock = &st.locks[role].watch;
        let (p, n) = lock.holder?;
        let idle = !Self::busy(st, p, n) && lock.idle_since + s.ticks(s.timing.ttl) < st.now;
        (idle && !s.breaks.no_idle_watch_end).then_some((p, n))
    }

    /// The backend a direct or polling standby's observer may terminate
    /// for `role` now (the session backend's zombie preemption,
    /// `preempt`, see [`ElectionModel::zombie`]), and the time by
    /// which it does, one `check_every` after it became possible. The
    /// observer is not modelled as a connection: it needs a healthy (up,
    /// reachable) process other than the holder's to run the check.
    /// Watched standbys have no observer: their watch preempts, with its
    /// own statements.
    pub(super) fn preemptable(&self, st: &State, role: usize) -> Option<((u8, u8), u32)> {
        let s = &self.s;
        if s.backend != Backend::Session || s.standby == Standby::Watched {
            return None;
        }
        let lock = &st.locks[role].role;
        let p = lock.holder?.0;
        if !(0..st.procs.len())
            .any(|q| q != p as usize && st.procs[q].life == Life::Up && !st.procs[q].partitioned)
        {
            return None;
        }
        // Preemptable by a backend of no process.
        let (p, n) = self.zombie(st, role, (u8::MAX, 0))?;
        let check = s.ticks(s.timing.check_every);
        if st.rows[role].holder == Some((p, n)) {
            return Some(((p, n), st.rows[role].lease_until + check));
        }
        // The due time follows the idle clock alone: a row that names
        // another backend was last renewed while that backend held the
        // lock, so before this holder's grant, and its lease has expired
        // by the end of the idle TTL.
        Some(((p, n), lock.idle_since + s.ticks(s.timing.ttl) + check))
    }
}
