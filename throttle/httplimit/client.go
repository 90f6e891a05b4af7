package httplimit

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"net/http"
	"net/netip"
	"strings"
)

// Anonymous is the Client.ID of requests without an API key.
const Anonymous = "anonymous"

// Client is who a request comes from, as the Limiter sees it.
type Client struct {
	// IP is the client's address (see Limiter.Client); the zero Addr when
	// the peer's address could not be parsed (a Unix socket).
	IP netip.Addr
	// ID is Anonymous, or "key:" and 32 hex digits of a SHA-256 of the API
	// key: the same for every request with that key, and safe to log.
	ID string
}

type clientContextKey struct{}

// ClientFrom returns the Client that the Middleware resolved for the
// request whose context is ctx, for handlers that log it.
func ClientFrom(ctx context.Context) (Client, bool) {
	c, ok := ctx.Value(clientContextKey{}).(Client)
	return c, ok
}

// Client resolves who r comes from.
//
// ID comes from the API key header (Config.ClientHeader). It is hashed
// before it is used anywhere, so API keys never appear in Redis keys,
// metrics or logs.
//
// IP is the peer's address (r.RemoteAddr) unless the peer is a trusted
// proxy (Config.TrustedProxies). Then X-Forwarded-For, all its field lines
// taken as one list, is read from the right, where each trusted proxy
// appended the address it saw. Addresses of trusted proxies are skipped;
// the first other address is the client. Everything to its left was
// written by the client itself or by proxies we know nothing of, and is
// ignored, so a client cannot choose its own address by sending the header.
// A malformed entry stops the walk: it was written by the last trusted hop
// reached, whose own address is then taken as the client's (requests
// through a proxy that writes garbage share its limits, rather than
// escaping them). If every entry is a trusted proxy, the leftmost one is
// the client; without X-Forwarded-For, the peer is. Entries may carry a port
// ("192.0.2.1:4711", "[2001:db8::1]:4711"); IPv4-mapped IPv6 addresses
// count as IPv4.
func (l *Limiter) Client(r *http.Request) Client {
	return Client{IP: l.clientIP(r), ID: clientID(r.Header.Get(l.header))}
}

func clientID(apiKey string) string {
	if apiKey == "" {
		return Anonymous
	}
	sum := sha256.Sum256([]byte(apiKey))
	return "key:" + hex.EncodeToString(sum[:16])
}

func (l *Limiter) clientIP(r *http.Request) netip.Addr {
	client := parseAddr(r.RemoteAddr)
	if !l.trusts(client) {
		return client
	}
	lines := r.Header.Values("X-Forwarded-For")
	for i := len(lines) - 1; i >= 0; i-- {
		// Walk the line from its end without splitting it: the header may
		// be long, and only its right end is ever read.
		for rest, done := lines[i], false; !done; {
			var hop string
			if j := strings.LastIndexByte(rest, ','); j >= 0 {
				rest, hop = rest[:j], rest[j+1:]
			} else {
				hop, done = rest, true
			}
			addr := parseAddr(strings.TrimSpace(hop))
			if !addr.IsValid() {
				return client
			}
			if !l.trusts(addr) {
				return addr
			}
			client = addr
		}
	}
	return client
}

func (l *Limiter) trusts(addr netip.Addr) bool {
	for _, p := range l.trusted {
		if p.Contains(addr) {
			return true
		}
	}
	return false
}

// parseAddr parses an address with or without a port; the zero Addr if s is
// neither.
func parseAddr(s string) netip.Addr {
	addr, err := netip.ParseAddr(s)
	if err != nil {
		ap, err := netip.ParseAddrPort(s)
		if err != nil {
			return netip.Addr{}
		}
		addr = ap.Addr()
	}
	return addr.Unmap().WithZone("")
}

// ipKey is the key of addr for ip limits and bans: the address, or its
// network for IPv6.
func (l *Limiter) ipKey(addr netip.Addr) string {
	if !addr.IsValid() {
		return "unknown"
	}
	if addr.Is6() && l.v6bits < 128 {
		p, _ := addr.Prefix(l.v6bits)
		return p.String()
	}
	return addr.String()
}
