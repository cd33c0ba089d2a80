//! pgelect next to a primary that changes: multi-host URLs on the kit's
//! ordinary servers (`reconnect`), and a real HA manager, pg_auto_failover
//! (`manager`; the slow cases run with `PGELECT_HA_TESTS=1`, see
//! `scripts/ha-tests.sh`).

mod manager;
mod reconnect;
