package server

import (
	"os"
	"path/filepath"
	"testing"
	"time"
)

// R17.4: [[export.sinks]] tables configure the export; a sink the exporter
// could not run is a config error when the file is loaded.
func TestExportConfigR17_4(t *testing.T) {
	secret := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(secret, []byte("t0ken\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	base := "[store]\npath = \"/tmp/bc.db\"\n"
	for _, c := range []struct {
		name, toml string
		sinks      int
		err        string
	}{
		{name: "none", toml: base},
		{name: "webhook and file", sinks: 2, toml: base + `[export]
lease = "5s"
[[export.sinks]]
kind = "webhook"
url = "https://siem.example.com/ingest"
secret_file = "` + secret + `"
auth = "hmac"
kinds = ["audit"]
timeout = "3s"
[[export.sinks]]
kind = "file"
path = "/var/log/bc/audit.jsonl"
`},
		{name: "unknown kind", toml: base + "[[export.sinks]]\nkind = \"kafka\"\n", err: `kind "kafka"`},
		{name: "bad url", toml: base + "[[export.sinks]]\nkind = \"webhook\"\nurl = \"ftp://x\"\n", err: "want an https URL"},
		// R23.1: http only to a loopback collector, and only when asked.
		{name: "http", toml: base + "[[export.sinks]]\nkind = \"webhook\"\nurl = \"http://127.0.0.1:8080/ingest\"\n", err: "set allow_http_loopback"},
		{name: "http elsewhere", toml: base + "[[export.sinks]]\nkind = \"webhook\"\nurl = \"http://siem.example.com/ingest\"\nallow_http_loopback = true\n", err: `not "siem.example.com"`},
		{name: "http loopback", sinks: 1, toml: base + "[[export.sinks]]\nkind = \"webhook\"\nurl = \"http://[::1]:8080/ingest\"\nallow_http_loopback = true\n"},
		{name: "credentials in url", toml: base + "[[export.sinks]]\nkind = \"webhook\"\nurl = \"https://u:p@siem.example.com/\"\n", err: "use secret_file"},
		{name: "missing secret", toml: base + "[[export.sinks]]\nkind = \"webhook\"\nurl = \"https://x\"\nsecret_file = \"/nonexistent/s\"\n", err: "secret_file"},
		{name: "unknown row kind", toml: base + "[[export.sinks]]\nkind = \"stdout\"\nkinds = [\"metrics\"]\n", err: `"metrics"`},
		{name: "same sink twice", toml: base + "[[export.sinks]]\nkind = \"stdout\"\n[[export.sinks]]\nkind = \"stdout\"\n", err: "a second sink"},
		{name: "unknown key", toml: base + "[[export.sinks]]\nkind = \"stdout\"\ncolour = \"red\"\n", err: "unknown keys"},
	} {
		t.Run(c.name, func(t *testing.T) {
			cfg, ok := parseCase(t, c.toml, c.err)
			if !ok {
				return
			}
			if len(cfg.Export.Sinks) != c.sinks {
				t.Fatalf("%d sinks, want %d", len(cfg.Export.Sinks), c.sinks)
			}
			if c.sinks == 2 && (cfg.Export.Lease != 5*time.Second || cfg.Export.Sinks[0].Timeout != 3*time.Second || cfg.Export.Sinks[0].Kinds[0] != "audit") {
				t.Fatalf("parsed %+v", cfg.Export)
			}
		})
	}
}
