package redistest

import (
	"crypto/tls"
	"net"
	"testing"

	"github.com/sluicehq/sluice/internal/testkit"
)

// StartTLSServer starts a redis-server that serves TLS only (--port 0) on
// a free loopback port, with args that name its certificate, key and CA
// (--tls-cert-file, --tls-key-file, --tls-ca-cert-file); client is how
// Start checks that it answers. It is stopped when the test ends.
func StartTLSServer(tb testing.TB, client *tls.Config, args ...string) *Server {
	tb.Helper()
	addr := testkit.FreeAddr(tb)
	_, port, _ := net.SplitHostPort(addr)
	// Later arguments win: these replace Start's --port.
	args = append([]string{"--port", "0", "--tls-port", port}, args...)
	s := &Server{Addr: addr, dir: tb.TempDir(), args: args, tls: client}
	s.Start(tb)
	tb.Cleanup(s.Kill)
	return s
}
