package h2server

import (
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"

	"github.com/better-compute/better-compute/internal/checks/tools"
)

// TestH2Spec runs h2spec (github.com/summerwind/h2spec) against the
// server in the clear and over TLS, the binary at $H2SPEC or on the PATH
// (.ci/run installs it; missing, the test fails under CI):
//
//	GOBIN=/tmp/bin go install github.com/summerwind/h2spec/cmd/h2spec@v2.2.1+incompatible
//	H2SPEC=/tmp/bin/h2spec go test -run H2Spec -v ./internal/gateway/h2server/
func TestH2Spec(t *testing.T) {
	bin := os.Getenv("H2SPEC")
	if bin == "" {
		bin = tools.Need(t, "h2spec", "HTTP/2 conformance of the server; set H2SPEC to its binary, or go install github.com/summerwind/h2spec/cmd/h2spec@v2.2.1+incompatible")
	}
	h := HTTP(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		_, _ = io.WriteString(w, "hello")
	}))
	for _, tc := range []struct {
		name string
		tls  bool
	}{{"clear", false}, {"tls", true}} {
		t.Run(tc.name, func(t *testing.T) {
			var addr string
			args := []string{"-S", "-o", "5"} // strict: the SHOULDs too
			if tc.tls {
				_, addr, _ = startTLS(t, Config{Handler: h})
				args = append(args, "-t", "-k")
			} else {
				_, addr = start(t, Config{Handler: h})
			}
			host, port, _ := net.SplitHostPort(addr)
			args = append(args, "-h", host, "-p", port)
			if extra := os.Getenv("H2SPEC_ARGS"); extra != "" {
				args = append(args, strings.Fields(extra)...) // e.g. "-v http2/6.7"
			}
			out, err := exec.Command(bin, args...).CombinedOutput()
			summary := regexp.MustCompile(`\d+ tests, \d+ passed, \d+ skipped, \d+ failed`).Find(out)
			t.Logf("h2spec: %s", summary)
			if err != nil {
				t.Fatalf("h2spec: %v\n%s", err, out)
			}
		})
	}
}
