package redistest

import (
	"context"
	"net"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/redis/go-redis/v9"
)

// Proxy is a TCP proxy in front of a real Redis server, for fault tests. It
// forwards both ways until told otherwise: LoseReplies makes a command
// reach Redis and run there while its reply never reaches the client (the
// connection breaks in between, as when a network or a server fails
// mid-call); Cut makes Redis unreachable until Mend; Silence makes the
// connections open carry nothing.
type Proxy struct {
	Addr string // where clients connect

	target string
	ln     net.Listener

	mu    sync.Mutex
	lose  int // replies still to lose
	lost  int // replies lost so far
	cut   bool
	links map[*link]struct{}
	wg    sync.WaitGroup
}

// link is one client connection and its connection to Redis.
type link struct {
	client, server net.Conn
	silent         atomic.Bool // Silence: bytes are read and dropped
}

func (l *link) close() {
	l.client.Close()
	l.server.Close()
}

// NewProxy starts a proxy on a free loopback port that forwards to target
// (host:port) and stops it when the test ends.
func NewProxy(tb testing.TB, target string) *Proxy {
	tb.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	p := &Proxy{Addr: ln.Addr().String(), target: target, ln: ln, links: map[*link]struct{}{}}
	p.wg.Go(p.accept)
	tb.Cleanup(p.close)
	return p
}

// LoseReplies makes the proxy lose the next n replies Redis sends: it does
// not pass them on, and closes their client's connection instead. The
// command they answer ran on the server; the client cannot know whether it
// did. Open the client's connection before (a PING) so that what is lost
// is the reply to the command under test, not to the handshake of a new
// connection.
func (p *Proxy) LoseReplies(n int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.lose = n
}

// Lost is how many replies the proxy has lost so far.
func (p *Proxy) Lost() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.lost
}

// Cut closes every connection and refuses new ones (they are accepted and
// closed at once) until Mend: Redis is unreachable.
func (p *Proxy) Cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cut = true
	for l := range p.links {
		l.close()
	}
}

// Silence makes every connection open now carry nothing, either way, and
// stay open, as when the host at the other end dies or the network parts
// without a word: only a timeout tells. New connections work.
func (p *Proxy) Silence() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for l := range p.links {
		l.silent.Store(true)
	}
}

// Mend ends a Cut: new connections reach Redis again.
func (p *Proxy) Mend() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cut = false
}

func (p *Proxy) accept() {
	for {
		client, err := p.ln.Accept()
		if err != nil {
			return // closed
		}
		p.mu.Lock()
		cut := p.cut
		p.mu.Unlock()
		if cut {
			client.Close()
			continue
		}
		server, err := net.Dial("tcp", p.target)
		if err != nil {
			client.Close()
			continue
		}
		l := &link{client: client, server: server}
		p.mu.Lock()
		p.links[l] = struct{}{}
		p.mu.Unlock()
		p.wg.Go(func() { p.forward(l, l.client, l.server, false) })
		p.wg.Go(func() { p.forward(l, l.server, l.client, true) })
	}
}

// forward copies from one end of l to the other until either end closes;
// replies (from the server) pass the LoseReplies check first.
func (p *Proxy) forward(l *link, from, to net.Conn, replies bool) {
	defer func() {
		l.close()
		p.mu.Lock()
		delete(p.links, l)
		p.mu.Unlock()
	}()
	buf := make([]byte, 32<<10)
	for {
		n, err := from.Read(buf)
		if n > 0 && replies && p.loseOne() {
			return
		}
		if n > 0 && !l.silent.Load() {
			if _, err := to.Write(buf[:n]); err != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// loseOne reports whether the reply just read is to be lost, and counts it.
func (p *Proxy) loseOne() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.lose == 0 {
		return false
	}
	p.lose--
	p.lost++
	return true
}

func (p *Proxy) close() {
	p.ln.Close()
	p.mu.Lock()
	for l := range p.links {
		l.close()
	}
	p.mu.Unlock()
	p.wg.Wait()
}

// ProxiedClient is a client of the standalone server with go-redis's
// default options, as most callers build one, whose connections go
// through a Proxy. It is closed when the test ends.
func ProxiedClient(tb testing.TB) (*redis.Client, *Proxy) {
	tb.Helper()
	p := NewProxy(tb, Addr(tb))
	rdb := redis.NewClient(&redis.Options{Addr: p.Addr})
	ping(tb, rdb)
	return rdb, p
}

// ProxiedCluster is a client of the cluster with go-redis's default
// options whose connections to each master go through a Proxy of its own,
// by the master's address. It is closed when the test ends.
func ProxiedCluster(tb testing.TB) (*redis.ClusterClient, map[string]*Proxy) {
	tb.Helper()
	proxies := map[string]*Proxy{}
	for _, addr := range ClusterAddrs(tb) {
		proxies[addr] = NewProxy(tb, addr)
	}
	var d net.Dialer
	rdb := redis.NewClusterClient(&redis.ClusterOptions{
		Addrs: ClusterAddrs(tb),
		// The client knows the nodes by the addresses they announce; it
		// reaches each through its proxy.
		Dialer: func(ctx context.Context, network, addr string) (net.Conn, error) {
			if p, ok := proxies[addr]; ok {
				addr = p.Addr
			}
			return d.DialContext(ctx, network, addr)
		},
	})
	ping(tb, rdb)
	return rdb, proxies
}
