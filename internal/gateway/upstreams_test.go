package gateway

import (
	"errors"
	"fmt"
	"net"
	"strings"
	"testing"

	"github.com/better-compute/better-compute/gen/bettercompute/agent/v1/agentv1connect"
)

// R4.9: a call that failed on one replica goes to another only
// where that is idempotent: a join always (asked again it gets its stored
// answer), a renewal only when it never reached a replica.
func TestRetryableOnAnotherReplica(t *testing.T) {
	dial := fmt.Errorf("post: %w", &net.OpError{Op: "dial", Net: "tcp", Err: errors.New("connection refused")})
	reset := fmt.Errorf("post: %w", &net.OpError{Op: "read", Net: "tcp", Err: errors.New("connection reset by peer")})
	for _, c := range []struct {
		name, proc string
		err        error
		want       bool
	}{
		{"join, refused connection", agentv1connect.JoinServiceJoinProcedure, dial, true},
		{"join, reset mid-call", agentv1connect.JoinServiceJoinProcedure, reset, true},
		{"renewal, refused connection", agentv1connect.JoinServiceRenewProcedure, dial, true},
		{"renewal, reset mid-call: may have superseded its certificate", agentv1connect.JoinServiceRenewProcedure, reset, false},
	} {
		if got := retryable(c.proc, c.err); got != c.want {
			t.Errorf("%s: retryable %v, want %v", c.name, got, c.want)
		}
	}
}

// api_url or api_urls, each an https URL, none twice.
func TestConfigAPIURLs(t *testing.T) {
	base := Config{CertFile: "c", KeyFile: "k", APICAFile: "ca"}
	for _, c := range []struct {
		name    string
		url     string
		urls    []string
		wantErr string
	}{
		{"one", "https://a:1", nil, ""},
		{"several", "", []string{"https://a:1", "https://b:1"}, ""},
		{"none", "", nil, "api_url"},
		{"both", "https://a:1", []string{"https://b:1"}, "not both"},
		{"twice", "", []string{"https://a:1", "https://a:1/"}, "twice"},
		{"not https", "", []string{"https://a:1", "http://b:1"}, "api_urls"},
	} {
		cfg := base
		cfg.APIURL, cfg.APIURLs = c.url, c.urls
		err := cfg.validate()
		switch {
		case c.wantErr == "" && err != nil:
			t.Errorf("%s: %v", c.name, err)
		case c.wantErr != "" && (err == nil || !strings.Contains(err.Error(), c.wantErr)):
			t.Errorf("%s: %v, want an error with %q", c.name, err, c.wantErr)
		}
	}
}
