//! pgelect next to a primary that changes: multi-host URLs on the kit's
//! ordinary servers (`reconnect`), and a real HA manager, pg_auto_failover
//! (`manager`: candidates on the data nodes' multi-host URL; `pooled`: the
//! lease backend through one PgBouncer per data node; the slow cases run
//! with `PGELECT_HA_TESTS=1`, see `scripts/ha-tests.sh`).

mod manager;
mod pooled;
mod reconnect;
