//! Real network partitions for `pgelect chaos`: each candidate in a network
//! namespace of its own, joined by a veth pair to a private bridge in the
//! root namespace, where the throwaway server also listens. Cutting a
//! candidate off sets the host end of its veth down: the kernel drops its
//! frames silently in both directions, nobody acknowledges anything, and the
//! TCP timers on both ends (the server's keepalives and `tcp_user_timeout`,
//! the client's own) end the connections. A userland proxy that stops
//! forwarding cannot do that: its kernel keeps acknowledging.
//!
//! Only iproute2 (`ip`) is used, no netem or firewall. Every name carries
//! this process's pid (`pgelect-chaos-<pid>-<slot>`, `pgcb<pid>`,
//! `pgch<pid>x<slot>`), so concurrent runs never collide and leftovers of
//! dead runs (their pid gone) are removed at the next start. The only
//! addresses touched are those of the private subnet this module assigns
//! (a `10.213.K.0/24` no interface or route of the machine uses) on
//! interfaces it created.

use std::net::Ipv4Addr;
use std::process::Command;

/// Whether partitions can be made here; `Err` says why not.
pub fn available() -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    // /proc/self belongs to the effective user.
    if std::fs::metadata("/proc/self")
        .map(|m| m.uid())
        .unwrap_or(1)
        != 0
    {
        return Err("not root: network namespaces need CAP_NET_ADMIN".into());
    }
    ip(&["netns", "list"])
        .map(drop)
        .map_err(|e| format!("`ip netns` unavailable: {e}"))
}

/// Runs `ip ARGS`; its standard output, or what it said on failure.
fn ip(args: &[&str]) -> Result<String, String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("cannot run ip: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "ip {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

fn pid_alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// The pid in a name `prefix<pid>[suffix]`, where the pid ends at the
/// first non-digit.
fn pid_in(name: &str, prefix: &str) -> Option<u32> {
    let rest = name.strip_prefix(prefix)?;
    let end = rest
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(rest.len());
    rest[..end].parse().ok()
}

/// Removes namespaces, bridges and veths of runs whose process is gone.
/// Returns what it removed.
pub fn remove_leftovers() -> Vec<String> {
    let mut removed = Vec::new();
    if let Ok(list) = ip(&["netns", "list"]) {
        for name in list.lines().filter_map(|l| l.split_whitespace().next()) {
            if pid_in(name, "pgelect-chaos-").is_some_and(|p| !pid_alive(p))
                && ip(&["netns", "del", name]).is_ok()
            {
                removed.push(name.to_owned());
            }
        }
    }
    if let Ok(list) = ip(&["-o", "link", "show"]) {
        for l in list.lines() {
            // "7: pgcb123@NONE: <...>" or "8: pgch123x0@if9: <...>"
            let Some(name) = l
                .split(": ")
                .nth(1)
                .map(|n| n.split('@').next().unwrap_or(n))
            else {
                continue;
            };
            let dead = ["pgcb", "pgch"]
                .iter()
                .any(|p| pid_in(name, p).is_some_and(|p| !pid_alive(p)));
            if dead && ip(&["link", "del", name]).is_ok() {
                removed.push(name.to_owned());
            }
        }
    }
    removed
}

/// The private bridge and the namespaces made on it; all removed on drop.
pub struct Net {
    pid: u32,
    subnet: u8,
    bridge: String,
    /// Slots in use (a slot is a namespace and its veth pair).
    used: Vec<bool>,
}

/// A candidate's namespace.
#[derive(Clone, Debug)]
pub struct Ns {
    pub name: String,
    slot: usize,
    host_veth: String,
}

/// At most this many namespaces at once (addresses .2 to .251).
const SLOTS: usize = 250;

impl Net {
    /// Makes the bridge `pgcb<pid>` with address `10.213.K.1/24`, K the
    /// first subnet the machine does not use.
    pub fn create() -> Result<Net, String> {
        let pid = std::process::id();
        let used = format!(
            "{}\n{}",
            ip(&["-4", "-o", "addr", "show"])?,
            ip(&["-4", "route", "show", "table", "all"])?
        );
        let subnet = (0..=255u16)
            .map(|k| ((u16::from((pid % 200) as u8) + k) % 256) as u8)
            .find(|k| !used.contains(&format!("10.213.{k}.")))
            .ok_or("every 10.213.K.0/24 is in use on this machine")?;
        let net = Net {
            pid,
            subnet,
            bridge: format!("pgcb{pid}"),
            used: vec![false; SLOTS],
        };
        ip(&["link", "add", "name", &net.bridge, "type", "bridge"])?;
        // From here on, drop removes what was made.
        ip(&[
            "addr",
            "add",
            &format!("{}/24", net.host_addr()),
            "dev",
            &net.bridge,
        ])?;
        ip(&["link", "set", "dev", &net.bridge, "up"])?;
        Ok(net)
    }

    /// The bridge's address, where the server listens for the namespaces.
    pub fn host_addr(&self) -> Ipv4Addr {
        Ipv4Addr::new(10, 213, self.subnet, 1)
    }

    /// The bridge's name.
    pub fn bridge(&self) -> &str {
        &self.bridge
    }

    /// The subnet, for `pg_hba.conf`.
    pub fn cidr(&self) -> String {
        format!("10.213.{}.0/24", self.subnet)
    }

    /// A new namespace with a veth pair on the bridge, up, with an address.
    pub fn add(&mut self) -> Result<Ns, String> {
        let slot = self
            .used
            .iter()
            .position(|u| !u)
            .ok_or("no free network namespace slot")?;
        let ns = Ns {
            name: format!("pgelect-chaos-{}-{slot}", self.pid),
            slot,
            host_veth: format!("pgch{}x{slot}", self.pid),
        };
        self.used[slot] = true;
        let peer = format!("pgcp{}x{slot}", self.pid);
        let addr = format!("10.213.{}.{}/24", self.subnet, slot + 2);
        let made = (|| {
            ip(&["netns", "add", &ns.name])?;
            ip(&[
                "link",
                "add",
                &ns.host_veth,
                "type",
                "veth",
                "peer",
                "name",
                &peer,
            ])?;
            ip(&["link", "set", "dev", &peer, "netns", &ns.name])?;
            ip(&["link", "set", "dev", &ns.host_veth, "master", &self.bridge])?;
            ip(&["link", "set", "dev", &ns.host_veth, "up"])?;
            let inside = |args: &[&str]| {
                let mut all = vec!["-n", ns.name.as_str()];
                all.extend_from_slice(args);
                ip(&all)
            };
            inside(&["link", "set", "dev", "lo", "up"])?;
            inside(&["addr", "add", &addr, "dev", &peer])?;
            inside(&["link", "set", "dev", &peer, "up"])?;
            Ok::<(), String>(())
        })();
        match made {
            Ok(()) => Ok(ns),
            Err(e) => {
                self.remove(&ns);
                Err(e)
            }
        }
    }

    /// Removes a namespace (its veth pair goes with it).
    pub fn remove(&mut self, ns: &Ns) {
        let _ = ip(&["netns", "del", &ns.name]);
        // The pair is destroyed with the namespace once no process is left
        // in it; delete the host end now so the slot can be reused.
        let _ = ip(&["link", "del", &ns.host_veth]);
        self.used[ns.slot] = false;
    }

    /// Cuts `ns` off (`cut`) or reconnects it: the host end of its veth
    /// down or up. Frames are dropped silently while it is down.
    pub fn set_cut(&self, ns: &Ns, cut: bool) -> Result<(), String> {
        let state = if cut { "down" } else { "up" };
        ip(&["link", "set", "dev", &ns.host_veth, state]).map(drop)
    }

    /// `ip netns exec NS`: the command line prefix that runs a program in
    /// `ns` (ip execs it: the pid is the program's).
    pub fn exec_prefix(ns: &Ns) -> [String; 3] {
        ["netns".into(), "exec".into(), ns.name.clone()]
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for slot in 0..SLOTS {
            if self.used[slot] {
                let _ = ip(&[
                    "netns",
                    "del",
                    &format!("pgelect-chaos-{}-{slot}", self.pid),
                ]);
                let _ = ip(&["link", "del", &format!("pgch{}x{slot}", self.pid)]);
            }
        }
        let _ = ip(&["link", "del", &self.bridge]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_carry_the_pid() {
        assert_eq!(pid_in("pgelect-chaos-123-4", "pgelect-chaos-"), Some(123));
        assert_eq!(pid_in("pgch77x3", "pgch"), Some(77));
        assert_eq!(pid_in("pgcb9", "pgcb"), Some(9));
        assert_eq!(pid_in("eth0", "pgch"), None);
        assert_eq!(pid_in("pgchx", "pgch"), None);
    }
}
