//! This process's own resource use, read from Linux's `/proc` when `/metrics` is scraped:
//! resident memory, open file descriptors and their limit, CPU time, start time.
//!
//! These are the figures an operator checks first when a sidecar misbehaves (is it leaking
//! memory or descriptors, is it busy), under the names every Prometheus client library
//! exports them with (`process_*`). Read on demand, never sampled in the background; on a
//! system without `/proc` nothing is read and the gauges stay at 0.

use std::time::Duration;

/// One reading of the process's resource use.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProcessStats {
    /// Resident set size, in bytes.
    pub resident_bytes: u64,
    /// Open file descriptors.
    pub open_fds: u64,
    /// The soft limit on open file descriptors.
    pub max_fds: u64,
    /// User and system CPU time used so far.
    pub cpu: Duration,
    /// When the process started, in seconds since the Unix epoch.
    pub start_time_secs: f64,
}

impl ProcessStats {
    /// Reads this process's figures; `None` where `/proc` cannot be read.
    pub fn read() -> Option<ProcessStats> {
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        let boot_secs = std::fs::read_to_string("/proc/stat")
            .ok()
            .and_then(|s| boot_time(&s))?;
        let open_fds = std::fs::read_dir("/proc/self/fd").ok()?.count() as u64;
        let max_fds = rlimit::getrlimit(rlimit::Resource::NOFILE)
            .map(|(soft, _)| soft)
            .unwrap_or(0);
        parse_stat(
            &stat,
            rustix::param::clock_ticks_per_second(),
            rustix::param::page_size() as u64,
            boot_secs,
        )
        .map(|(resident_bytes, cpu, start_time_secs)| ProcessStats {
            resident_bytes,
            open_fds,
            max_fds,
            cpu,
            start_time_secs,
        })
    }
}

/// The `btime` line of `/proc/stat`: boot time in seconds since the epoch.
fn boot_time(proc_stat: &str) -> Option<f64> {
    proc_stat
        .lines()
        .find_map(|l| l.strip_prefix("btime "))
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(|v| v as f64)
}

/// Resident bytes, CPU time and start time from a `/proc/<pid>/stat` line (proc(5)): the
/// fields after the command name, which is in parentheses and may hold spaces.
fn parse_stat(
    stat: &str,
    ticks_per_sec: u64,
    page_size: u64,
    boot_secs: f64,
) -> Option<(u64, Duration, f64)> {
    let after = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    // `fields[0]` is field 3 (state): field n is `fields[n - 3]`.
    let field = |n: usize| fields.get(n - 3)?.parse::<u64>().ok();
    let ticks = ticks_per_sec.max(1);
    let (utime, stime, start, rss) = (field(14)?, field(15)?, field(22)?, field(24)?);
    let cpu = Duration::from_secs_f64((utime + stime) as f64 / ticks as f64);
    let start_time = boot_secs + start as f64 / ticks as f64;
    Some((rss.saturating_mul(page_size), cpu, start_time))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stat_line_with_spaces_in_the_command_name_is_read() {
        // proc(5): pid (comm) state ppid ... utime(14) stime(15) ... starttime(22) vsize(23)
        // rss(24) ...
        let line = "4242 (my (odd) proxy) S 1 4242 4242 0 -1 4194560 1000 0 0 0 \
                    250 50 0 0 20 0 8 0 12345 104857600 2560 18446744073709551615";
        let (rss, cpu, start) = parse_stat(line, 100, 4096, 1_700_000_000.0).expect("parsed");
        assert_eq!(rss, 2560 * 4096);
        assert_eq!(cpu, Duration::from_secs(3));
        assert_eq!(start, 1_700_000_000.0 + 123.45);
        assert_eq!(parse_stat("4242 (cut", 100, 4096, 0.0), None);
        assert_eq!(boot_time("cpu 1 2 3\nbtime 1700000000\n"), Some(1.7e9));
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn this_process_is_read_from_proc() {
        let s = ProcessStats::read().expect("/proc is readable");
        assert!(s.resident_bytes > 1 << 20, "{s:?}");
        assert!(s.open_fds >= 3 && s.open_fds <= s.max_fds, "{s:?}");
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("after the epoch")
            .as_secs_f64();
        assert!(s.start_time_secs <= now + 1.0 && s.start_time_secs > now - 86_400.0 * 365.0);
    }
}
