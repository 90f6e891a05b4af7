package testkit

import (
	"fmt"
	"net"
	"os"
	"testing"
)

// TestFreePortOutsideEphemeral: the ports handed out are below the kernel's
// ephemeral range, so that no listener on :0 and no outgoing connection
// can take one before the server it is for binds it (in CI a worker's
// metrics port, found by listening on :0 and closing, went to another
// test's stand-in API first), and no port is handed out twice while a test
// holds it.
func TestFreePortOutsideEphemeral(t *testing.T) {
	low, high := 32768, 60999
	if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range"); err == nil {
		fmt.Sscan(string(b), &low, &high)
	}
	seen := map[int]bool{}
	for range 300 {
		port := FreePort(t)
		if port >= low && port <= high {
			t.Fatalf("port %d is in the kernel's ephemeral range [%d, %d]", port, low, high)
		}
		if seen[port] {
			t.Fatalf("port %d handed out twice", port)
		}
		seen[port] = true
	}
	for port := range seen {
		ln, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port))
		if err != nil {
			t.Fatalf("port %d is not free: %v", port, err)
		}
		ln.Close()
	}
}

// TestFreePortNotRefusedByBrowsers: no port is handed out that a browser
// refuses to load a page from: a worker's limits page on 6668 failed in
// Chromium with net::ERR_UNSAFE_PORT.
func TestFreePortNotRefusedByBrowsers(t *testing.T) {
	for _, refused := range []int{2049, 5060, 6000, 6665, 6666, 6667, 6668, 6669, 6697, 10080} {
		candidates := []int{refused, 7001}
		port, release, err := reservePort(func() int {
			p := candidates[0]
			candidates = candidates[1:]
			return p
		})
		if err != nil {
			t.Fatal(err)
		}
		release()
		if port != 7001 {
			t.Errorf("port %d handed out; browsers refuse it (net::ERR_UNSAFE_PORT)", port)
		}
	}
}
