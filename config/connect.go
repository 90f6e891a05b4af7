package config

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"strings"

	"github.com/redis/go-redis/v9"
)

// RefusedError is a connection that Redis, or the TLS handshake with it,
// refused for a reason in the config: a wrong password, a certificate
// that the configured CA did not sign. Trying again will not help; Key
// must change.
type RefusedError struct {
	Key     string // the key to change, as config.yaml spells it: redis.password
	Problem string // what is wrong, naming the server
	Err     error  // what the client saw
}

// Error is "<key>: <problem> (<what the client saw>)".
func (e *RefusedError) Error() string { return fmt.Sprintf("%s: %s (%v)", e.Key, e.Problem, e.Err) }

// Unwrap returns what the client saw.
func (e *RefusedError) Unwrap() error { return e.Err }

// Ping checks that rdb, a client made from r, reaches Redis and is let
// in. A refusal that comes from the config is a *RefusedError naming the
// key to change; any other failure (Redis down, loading, ctx ended) is an
// error that says where it tried.
func (r Redis) Ping(ctx context.Context, rdb redis.UniversalClient) error {
	err := rdb.Ping(ctx).Err()
	if err == nil {
		return nil
	}
	if refused := r.refused(err); refused != nil {
		return refused
	}
	return fmt.Errorf("cannot reach %s: %w", r.where(), err)
}

// where names the server(s) r points at, for messages.
func (r Redis) where() string {
	if len(r.Cluster) > 0 {
		return fmt.Sprintf("the Redis Cluster at %s", strings.Join(r.Cluster, ", "))
	}
	return "Redis at " + r.Addr
}

// refused explains err by the key of r to change, or returns nil if err
// does not come from the config.
func (r Redis) refused(err error) *RefusedError {
	at := r.where()
	user := r.Username
	if user == "" {
		user = "default"
	}
	var (
		unknownCA x509.UnknownAuthorityError
		badName   x509.HostnameError
		invalid   x509.CertificateInvalidError
	)
	switch {
	case redis.HasErrorPrefix(err, "WRONGPASS"):
		return &RefusedError{"redis.password", fmt.Sprintf("%s refused the login of user %q: the password is wrong, or there is no such user, or it is off", at, user), err}
	case redis.HasErrorPrefix(err, "NOAUTH"):
		return &RefusedError{"redis.password", at + " needs a password (and redis.username, for an ACL user)", err}
	case redis.HasErrorPrefix(err, "NOPERM"):
		return &RefusedError{"redis.username", fmt.Sprintf("%s lets user %q in but not run PING: give the user the commands the ACL in docs/security.md lists", at, user), err}
	case errors.As(err, &unknownCA):
		if r.TLSCaFile != "" {
			return &RefusedError{"redis.tls_ca_file", fmt.Sprintf("the certificate of %s is not signed by a CA in %s", at, r.TLSCaFile), err}
		}
		return &RefusedError{"redis.tls_ca_file", fmt.Sprintf("the certificate of %s is not signed by a CA this system trusts: set redis.tls_ca_file to the CA that signed it", at), err}
	case errors.As(err, &badName):
		var names []string
		if c := badName.Certificate; c != nil {
			names = append(names, c.DNSNames...)
			for _, ip := range c.IPAddresses {
				names = append(names, ip.String())
			}
		}
		return &RefusedError{"redis.tls_server_name", fmt.Sprintf("the certificate of %s is for %s, not %q: set redis.tls_server_name to a name it holds",
			at, strings.Join(names, ", "), badName.Host), err}
	case errors.As(err, &invalid):
		return &RefusedError{"redis.tls", fmt.Sprintf("the certificate of %s is not valid", at), err}
	case strings.Contains(err.Error(), "remote error: tls: "):
		// The server's TLS alert: Go has no type for it.
		if r.TLSCertFile == "" {
			return &RefusedError{"redis.tls_cert_file", at + " wants a client certificate: set redis.tls_cert_file and redis.tls_key_file", err}
		}
		return &RefusedError{"redis.tls_cert_file", fmt.Sprintf("%s refused the client certificate in %s", at, r.TLSCertFile), err}
	}
	return nil
}
