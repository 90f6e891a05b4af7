package config

import (
	"crypto"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"strings"
	"time"
)

// maxPEMFile bounds what is read of each TLS file: a CA bundle of a few
// hundred certificates is well below it.
const maxPEMFile = 1 << 20

// TLSConfig is the TLS setup of a client of r: nil without TLS. It reads
// r's TLS files each time it is called. For an r that Validate refuses
// (a file missing, not PEM, a key that does not match its certificate),
// it returns a config whose every handshake fails with those problems,
// never one that connects with less than r asks for.
func (r Redis) TLSConfig() *tls.Config {
	if !r.TLS {
		return nil
	}
	c, errs := r.tlsSetup()
	if len(errs) > 0 {
		err := fmt.Errorf("config: %w", errors.Join(errs...))
		return &tls.Config{MinVersion: tls.VersionTLS12, VerifyConnection: func(tls.ConnectionState) error { return err }}
	}
	return c
}

// tlsSetup reads and checks r's TLS files and returns the TLS config they
// make, or one problem per key that is wrong. An empty ServerName lets the
// TLS dialer take it from each node's address.
func (r Redis) tlsSetup() (*tls.Config, []error) {
	var p problems
	if !r.TLS {
		for _, k := range []struct{ key, value string }{
			{"redis.tls_ca_file", r.TLSCaFile}, {"redis.tls_cert_file", r.TLSCertFile},
			{"redis.tls_key_file", r.TLSKeyFile}, {"redis.tls_server_name", r.TLSServerName},
		} {
			if k.value != "" {
				p.add(k.key, "is set, but redis.tls is false: set redis.tls: true to connect with TLS")
			}
		}
		return nil, p
	}
	c := &tls.Config{MinVersion: tls.VersionTLS12, ServerName: r.TLSServerName}
	if name := r.TLSServerName; name != "" && !isHostName(name) {
		p.add("redis.tls_server_name", "must be a host name (or IP address) that the server's certificate holds, like redis.example.com, without a port, got %q", name)
	}
	if r.TLSCaFile != "" {
		certs, err := readCertificates(r.TLSCaFile)
		if err != nil {
			p.add("redis.tls_ca_file", "%v", err)
		} else {
			c.RootCAs = x509.NewCertPool()
			for _, cert := range certs {
				c.RootCAs.AddCert(cert)
			}
		}
	}
	switch {
	case r.TLSCertFile == "" && r.TLSKeyFile != "":
		p.add("redis.tls_cert_file", "must be set with redis.tls_key_file: the client certificate of that key")
	case r.TLSCertFile != "" && r.TLSKeyFile == "":
		p.add("redis.tls_key_file", "must be set with redis.tls_cert_file: the private key of that certificate")
	case r.TLSCertFile != "":
		cert, key, err := readKeyPair(r.TLSCertFile, r.TLSKeyFile)
		if err != nil {
			p.add(key, "%v", err)
		} else {
			c.Certificates = []tls.Certificate{cert}
		}
	}
	return c, p
}

// isHostName reports whether s can be a name in a certificate: an IP
// address, or a DNS name of letters, digits, dashes and dots.
func isHostName(s string) bool {
	if _, err := netip.ParseAddr(s); err == nil {
		return true
	}
	if len(s) > 253 || s == "" {
		return false
	}
	for _, c := range s {
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '-' || c == '.' || c == '_') {
			return false
		}
	}
	return true
}

// readPEM reads a PEM file of at most maxPEMFile bytes.
func readPEM(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("cannot read it: %w", err)
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, maxPEMFile+1))
	if err != nil {
		return nil, fmt.Errorf("cannot read it: %w", err)
	}
	if len(data) > maxPEMFile {
		return nil, fmt.Errorf("%s is larger than %d KiB: not a PEM file of certificates or a key", path, maxPEMFile>>10)
	}
	return data, nil
}

// readCertificates reads the certificates of a PEM file: at least one,
// each one valid.
func readCertificates(path string) ([]*x509.Certificate, error) {
	data, err := readPEM(path)
	if err != nil {
		return nil, err
	}
	var certs []*x509.Certificate
	for block, rest := pem.Decode(data); block != nil; block, rest = pem.Decode(rest) {
		if block.Type != "CERTIFICATE" {
			continue
		}
		cert, err := x509.ParseCertificate(block.Bytes)
		if err != nil {
			return nil, fmt.Errorf("%s: certificate %d cannot be read: %w", path, len(certs)+1, err)
		}
		certs = append(certs, cert)
	}
	if len(certs) == 0 {
		return nil, fmt.Errorf("%s holds no PEM certificate (a block that starts -----BEGIN CERTIFICATE-----)", path)
	}
	return certs, nil
}

// readKeyPair reads a client certificate and its private key; an error
// comes with the key (redis.tls_cert_file or redis.tls_key_file) that
// names the file at fault.
func readKeyPair(certFile, keyFile string) (pair tls.Certificate, key string, err error) {
	certs, err := readCertificates(certFile)
	if err != nil {
		return pair, "redis.tls_cert_file", err
	}
	leaf := certs[0]
	if now := time.Now(); now.After(leaf.NotAfter) || now.Before(leaf.NotBefore) {
		return pair, "redis.tls_cert_file", fmt.Errorf("%s: the certificate of %q is valid from %s to %s, not now",
			certFile, leaf.Subject.CommonName, leaf.NotBefore.UTC().Format(time.RFC3339), leaf.NotAfter.UTC().Format(time.RFC3339))
	}
	priv, err := readPrivateKey(keyFile)
	if err != nil {
		return pair, "redis.tls_key_file", err
	}
	pub, ok := priv.Public().(interface{ Equal(crypto.PublicKey) bool })
	if !ok || !pub.Equal(leaf.PublicKey) {
		return pair, "redis.tls_key_file", fmt.Errorf("%s is not the private key of the certificate in %s (redis.tls_cert_file)", keyFile, certFile)
	}
	pair = tls.Certificate{PrivateKey: priv, Leaf: leaf}
	for _, c := range certs {
		pair.Certificate = append(pair.Certificate, c.Raw)
	}
	return pair, "", nil
}

// readPrivateKey reads the first private key of a PEM file: PKCS #8, or
// PKCS #1 (RSA) or SEC 1 (EC) as openssl writes them.
func readPrivateKey(path string) (crypto.Signer, error) {
	data, err := readPEM(path)
	if err != nil {
		return nil, err
	}
	for block, rest := pem.Decode(data); block != nil; block, rest = pem.Decode(rest) {
		var key any
		switch block.Type {
		case "PRIVATE KEY":
			key, err = x509.ParsePKCS8PrivateKey(block.Bytes)
		case "RSA PRIVATE KEY":
			key, err = x509.ParsePKCS1PrivateKey(block.Bytes)
		case "EC PRIVATE KEY":
			key, err = x509.ParseECPrivateKey(block.Bytes)
		default:
			if strings.HasSuffix(block.Type, "PRIVATE KEY") {
				return nil, fmt.Errorf("%s holds a %s, which cannot be used: write it unencrypted, as PKCS #8 (openssl pkcs8 -topk8 -nocrypt)", path, block.Type)
			}
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("%s: the %s cannot be read: %w", path, block.Type, err)
		}
		if signer, ok := key.(crypto.Signer); ok {
			return signer, nil
		}
		return nil, fmt.Errorf("%s: a %T cannot sign a TLS handshake", path, key)
	}
	return nil, fmt.Errorf("%s holds no PEM private key (a block that starts -----BEGIN PRIVATE KEY-----)", path)
}
