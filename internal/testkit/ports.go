package testkit

import (
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
)

// Ports handed to servers a test starts later (a worker's metrics, an
// intake, Prometheus, a redis-server) come from below the range that
// scripts/redis-env.sh picks Redis's ports from (11000 and up, bus ports
// up to the kernel's ephemeral range), and so below the ephemeral range
// too. A port taken from the ephemeral range by listening on :0 and
// closing could be handed by the kernel to the next listener on :0 before
// our server bound it: in CI a worker's metrics port went to another
// test's stand-in API, the worker exited, and the test's requests reached
// that API (stop 35).
const (
	lowPort  = 2000
	highPort = 11000 // exclusive
)

// browserRefused are the ports in [lowPort, highPort) that browsers will
// not load a page from (the Fetch standard's "bad ports": Chromium answers
// net::ERR_UNSAFE_PORT). A worker's limits page on 6668 could not be opened
// in a test's Chromium (a run of the end-to-end package, 2026-12-07).
var browserRefused = map[int]bool{
	2049: true, 3659: true, 4045: true, 4190: true, 5060: true, 5061: true, 6000: true, 6566: true,
	6665: true, 6666: true, 6667: true, 6668: true, 6669: true, 6679: true, 6697: true, 10080: true,
}

// FreeAddr is a loopback address, 127.0.0.1:PORT, on which nothing
// listens and that no other test (in this process or in another of this
// machine's test processes) gets until tb ends.
func FreeAddr(tb testing.TB) string {
	tb.Helper()
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(FreePort(tb)))
}

// FreePort is FreeAddr's port.
func FreePort(tb testing.TB) int {
	tb.Helper()
	port, release, err := ReservePort()
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(release)
	return port
}

// ReservePort is a free port for code that runs outside a test (the
// benchmarks' fleets), reserved until release: by a lock on a file named
// after it, which the kernel drops if the process dies.
func ReservePort() (port int, release func(), err error) {
	return reservePort(func() int { return lowPort + rand.IntN(highPort-lowPort) })
}

// reservePort is ReservePort with the candidates drawn by next.
func reservePort(next func() int) (port int, release func(), err error) {
	dir := filepath.Join(os.TempDir(), "sluice-test-ports")
	if err := os.MkdirAll(dir, 0o777); err != nil {
		return 0, nil, fmt.Errorf("testkit: the directory of the port locks: %w", err)
	}
	for range 1000 {
		port := next()
		if browserRefused[port] {
			continue
		}
		lock, err := os.OpenFile(filepath.Join(dir, strconv.Itoa(port)), os.O_CREATE|os.O_RDWR, 0o666)
		if err != nil {
			return 0, nil, fmt.Errorf("testkit: a port's lock file: %w", err)
		}
		// flock locks belong to the open file: a second open of the same
		// file in this process is refused too.
		if syscall.Flock(int(lock.Fd()), syscall.LOCK_EX|syscall.LOCK_NB) != nil {
			lock.Close()
			continue
		}
		ln, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
		if err != nil { // something outside the tests has it
			lock.Close()
			continue
		}
		ln.Close()
		return port, func() { lock.Close() }, nil
	}
	return 0, nil, fmt.Errorf("testkit: no free port in [%d, %d) after 1000 tries: other tests hold them, or other servers listen there", lowPort, highPort)
}
