package httplimit_test

import (
	"fmt"
	"net/http/httptest"
	"net/netip"

	"github.com/redis/go-redis/v9"

	"github.com/sluicehq/sluice/throttle/httplimit"
)

// A request that came through two of our proxies (10.0.0.0/8): the client
// is the first address from the right that is not one of them; what the
// client wrote to the left of it is ignored. The API key is known by a hash.
func ExampleLimiter_Client() {
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:6379"})
	lim, err := httplimit.New(rdb, httplimit.Config{
		TrustedProxies: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")},
	})
	if err != nil {
		panic(err)
	}
	r := httptest.NewRequest("GET", "/", nil)
	r.RemoteAddr = "10.0.0.1:443"
	r.Header.Set("X-Forwarded-For", "198.51.100.1, 203.0.113.7, 10.0.0.2")
	r.Header.Set("X-API-Key", "k-123")
	c := lim.Client(r)
	fmt.Println(c.IP, c.ID)
	// Output: 203.0.113.7 key:3605a9e4358da4302f8acea41f0f52ce
}
