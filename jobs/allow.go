package jobs

import (
	"fmt"
	"net/netip"
	"net/url"
	"strconv"
	"strings"
)

// AllowList is what the http:request handler may call: the entries of
// http.allow, parsed by ParseAllowList. The zero AllowList allows nothing.
//
// An entry is a host name, an IP address or a CIDR, with or without a port:
//
//	api.example.com        the name, on the default port of the URL's scheme (80 for http, 443 for https)
//	api.example.com:8443   the name, on port 8443 only
//	203.0.113.7            the address, on the default ports
//	127.0.0.1:8080         the address, on port 8080 only
//	[::1]:9000             an IPv6 address with a port (brackets as in a URL)
//	10.20.0.0/16           every address of the network, on the default ports
//	10.20.0.0/16:8080      the network, on port 8080 only ([fd00::/8]:8080 for IPv6)
//
// A URL passes if an entry names its host (a name exactly, case aside, or
// an address within an address or CIDR entry) and its port. Then every
// address actually dialled, after DNS and on every redirect, is checked
// again: an address in a special range (loopback, link-local with the
// cloud metadata address 169.254.169.254, private, carrier-grade NAT,
// unspecified, multicast, reserved) passes only if an address or CIDR
// entry names it and the port. So a listed name that resolves to
// 127.0.0.1, or to 169.254.169.254, is refused unless that address is
// listed too.
type AllowList struct {
	names    []allowedName
	prefixes []allowedPrefix
}

type allowedName struct {
	host string // lower case
	port int    // 0: the scheme's default port
}

type allowedPrefix struct {
	prefix netip.Prefix
	port   int // 0: the default ports, 80 and 443
}

// ParseAllowList parses the entries of http.allow; an error names the
// first bad entry and what would be right.
func ParseAllowList(entries []string) (AllowList, error) {
	var a AllowList
	for i, entry := range entries {
		if err := a.add(entry); err != nil {
			return AllowList{}, configProblem(fmt.Sprintf("http.allow[%d]", i), "%v", err)
		}
	}
	return a, nil
}

func (a *AllowList) add(entry string) error {
	if strings.Contains(entry, "://") {
		return fmt.Errorf("%q is a URL; give its host, and a port if not the scheme's default (api.example.com:8443)", entry)
	}
	host, port, err := splitAllowEntry(strings.TrimSpace(entry))
	if err != nil {
		return err
	}
	if p, err := netip.ParsePrefix(host); err == nil {
		if p != p.Masked() {
			return fmt.Errorf("%q: the network has bits set past its /%d; did you mean %s?", entry, p.Bits(), p.Masked())
		}
		a.prefixes = append(a.prefixes, allowedPrefix{unmapPrefix(p), port})
		return nil
	}
	if ip, err := netip.ParseAddr(host); err == nil {
		ip = ip.Unmap().WithZone("")
		a.prefixes = append(a.prefixes, allowedPrefix{netip.PrefixFrom(ip, ip.BitLen()), port})
		return nil
	}
	if !isHostName(host) {
		return fmt.Errorf("%q is not a host name, an IP address or a CIDR, with an optional :port (like api.example.com, api.example.com:8443, 127.0.0.1:8080, [::1]:9000 or 10.0.0.0/8)", entry)
	}
	a.names = append(a.names, allowedName{strings.ToLower(strings.TrimSuffix(host, ".")), port})
	return nil
}

// splitAllowEntry splits an entry into its host (a name, an address or a
// CIDR) and its port, 0 if it has none.
func splitAllowEntry(entry string) (string, int, error) {
	host, portText := entry, ""
	if strings.HasPrefix(entry, "[") {
		end := strings.IndexByte(entry, ']')
		if end < 0 {
			return "", 0, fmt.Errorf("%q: missing ']'", entry)
		}
		host, portText = entry[1:end], entry[end+1:]
		if portText != "" {
			var ok bool
			if portText, ok = strings.CutPrefix(portText, ":"); !ok {
				return "", 0, fmt.Errorf("%q: want [address]:port", entry)
			}
		}
	} else if i := strings.LastIndexByte(entry, ':'); i >= 0 && strings.Count(entry, ":") == 1 {
		// One colon: host:port. More are a bare IPv6 address, which
		// takes no port without brackets.
		host, portText = entry[:i], entry[i+1:]
	}
	if portText == "" {
		if strings.HasSuffix(entry, ":") {
			return "", 0, fmt.Errorf("%q: the port is missing after ':'", entry)
		}
		return host, 0, nil
	}
	port, err := strconv.Atoi(portText)
	if err != nil || port < 1 || port > 65535 {
		return "", 0, fmt.Errorf("%q: the port must be a number from 1 to 65535, got %q", entry, portText)
	}
	return host, port, nil
}

func isHostName(s string) bool {
	if s == "" || len(s) > 253 {
		return false
	}
	for _, label := range strings.Split(strings.TrimSuffix(s, "."), ".") {
		if label == "" || len(label) > 63 || label[0] == '-' || label[len(label)-1] == '-' {
			return false
		}
		for _, c := range []byte(label) {
			if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '-' || c == '_') {
				return false
			}
		}
	}
	return true
}

func unmapPrefix(p netip.Prefix) netip.Prefix {
	if p.Addr().Is4In6() && p.Bits() >= 96 {
		return netip.PrefixFrom(p.Addr().Unmap(), p.Bits()-96)
	}
	return p
}

// defaultPort is the port a URL of scheme names without one.
func defaultPort(scheme string) int {
	if scheme == "https" {
		return 443
	}
	return 80
}

// checkURL says why u may not be called, or nil if an entry names its
// host and port.
func (a AllowList) checkURL(u *url.URL) error {
	port := defaultPort(u.Scheme)
	if p := u.Port(); p != "" {
		n, err := strconv.Atoi(p)
		if err != nil {
			return fmt.Errorf("host %q: bad port %q", u.Hostname(), p)
		}
		port = n
	}
	host := strings.ToLower(strings.TrimSuffix(u.Hostname(), "."))
	if ip, err := netip.ParseAddr(host); err == nil {
		if a.allowsAddr(ip.Unmap().WithZone(""), port, defaultPort(u.Scheme)) {
			return nil
		}
		return fmt.Errorf("address %s port %d is not in http.allow", host, port)
	}
	for _, n := range a.names {
		if n.host == host && (n.port == port || n.port == 0 && port == defaultPort(u.Scheme)) {
			return nil
		}
	}
	return fmt.Errorf("host %q port %d is not in http.allow", host, port)
}

// allowsAddr reports whether an address or CIDR entry names ip and port;
// an entry without a port names defaultPort.
func (a AllowList) allowsAddr(ip netip.Addr, port, defaultPort int) bool {
	for _, p := range a.prefixes {
		if p.prefix.Contains(ip) && (p.port == port || p.port == 0 && port == defaultPort) {
			return true
		}
	}
	return false
}

// RefusedAddressError is the error of a dial to an address in a special
// range that http.allow does not name.
type RefusedAddressError struct {
	Address netip.AddrPort
	Why     string // the range: "loopback", "private", ...
}

func (e *RefusedAddressError) Error() string {
	return fmt.Sprintf("address %s is %s and not in http.allow", e.Address, e.Why)
}

// checkDial says why the dialler may not connect to address (ip:port, as
// net.Dialer's Control receives it), or nil. The URL was checked already;
// here an address in a special range must be named by an address or CIDR
// entry, on the port dialled (an entry without a port: 80 or 443).
func (a AllowList) checkDial(address string) error {
	ap, err := netip.ParseAddrPort(address)
	if err != nil {
		return fmt.Errorf("http:request: cannot check the address dialled, %q: %w", address, err)
	}
	ip, port := ap.Addr().Unmap().WithZone(""), int(ap.Port())
	why := specialRange(ip)
	if why == "" || a.allowsAddr(ip, port, 80) || a.allowsAddr(ip, port, 443) {
		return nil
	}
	return &RefusedAddressError{netip.AddrPortFrom(ip, ap.Port()), why}
}

// Ranges no http:request reaches unless http.allow names them.
var (
	carrierGradeNAT = netip.MustParsePrefix("100.64.0.0/10")
	thisNetwork     = netip.MustParsePrefix("0.0.0.0/8")
	reservedV4      = netip.MustParsePrefix("240.0.0.0/4") // 255.255.255.255 (broadcast) included
)

// specialRange names the special range ip is in, "" for none.
func specialRange(ip netip.Addr) string {
	switch {
	case ip.IsLoopback():
		return "loopback"
	case ip == netip.AddrFrom4([4]byte{169, 254, 169, 254}):
		return "link-local (the cloud metadata service)"
	case ip.IsLinkLocalUnicast():
		return "link-local"
	case ip.IsPrivate():
		return "private"
	case carrierGradeNAT.Contains(ip):
		return "carrier-grade NAT"
	case ip.IsUnspecified(), thisNetwork.Contains(ip):
		return "unspecified"
	case ip.IsMulticast():
		return "multicast"
	case reservedV4.Contains(ip):
		return "reserved"
	}
	return ""
}
