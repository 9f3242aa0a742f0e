// Package doctor checks a machine's bcd setup the way an operator would
// debug it: the config, the pins and join key, the node identity, the
// gateway, the TPM. Each check says ok, warn or fail with a sentence that
// tells what to do.
package doctor

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"time"

	"crypto/tls"

	"github.com/better-compute/better-compute/internal/node/enroll"
	"github.com/better-compute/better-compute/internal/node/identity"
	"github.com/better-compute/better-compute/internal/node/servertime"
	"github.com/better-compute/better-compute/internal/node/tpmkeys"
	"github.com/better-compute/better-compute/internal/shared/bcdconfig"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/tpmverify"
)

// Status of a check.
const (
	OK   = "ok"
	Warn = "warn"
	Fail = "fail"
	Skip = "skip"
)

// Check is one finding.
type Check struct {
	Name   string `json:"name"`
	Status string `json:"status"`
	Detail string `json:"detail"`
}

// Options say what to check.
type Options struct {
	ConfigPath string
	// DataDir overrides the config's data_dir.
	DataDir string
	Clock   clock.Clock
	// DialTimeout bounds the gateway check (default 5 s).
	DialTimeout time.Duration
}

// Run runs every check and returns them in order.
func Run(ctx context.Context, o Options) []Check {
	if o.Clock == nil {
		o.Clock = clock.Real{}
	}
	if o.DialTimeout == 0 {
		o.DialTimeout = 5 * time.Second
	}
	var out []Check
	add := func(name, status, format string, args ...any) {
		out = append(out, Check{Name: name, Status: status, Detail: fmt.Sprintf(format, args...)})
	}
	cfg, err := bcdconfig.Load(o.ConfigPath)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			add("config", Fail, "%s does not exist: install bcd with its install script, or join with bcd join --server … (see docs/joining.md)", o.ConfigPath)
		} else {
			add("config", Fail, "%v", err)
		}
		// The identity can still be checked with --data-dir.
		if o.DataDir != "" {
			out = append(out, identityCheck(nil, o.DataDir, o.Clock.Now()))
		}
		return out
	}
	add("config", OK, "%s is valid (gateway %s, site %s)", o.ConfigPath, cfg.GatewayURL, cfg.Site)

	out = append(out, pinsCheck(cfg))
	if _, pin, found, err := bcdconfig.LoadEncryptionKeySet(filepath.Dir(o.ConfigPath), cfg.JoinEncryptionPins()); err != nil {
		add("join key", Fail, "%v", err)
	} else if !found {
		add("join key", Warn, "no %s beside the config: bcd join needs --server https://<control plane> to fetch the key", bcdconfig.EncryptionKeyFile)
	} else {
		add("join key", OK, "%s matches join-encryption pin %s", bcdconfig.EncryptionKeyFile, pin)
	}

	dataDir := cfg.DataDir
	if o.DataDir != "" {
		dataDir = o.DataDir
	}
	out = append(out, identityCheck(cfg, dataDir, o.Clock.Now()))
	out = append(out, clockCheck(dataDir))
	out = append(out, gatewayCheck(ctx, cfg, o))
	out = append(out, tpmCheck(cfg, dataDir))
	return out
}

// clockCheck reports the offset of the control plane's clock bcd learned
// last (R19.3): bcd corrects for it, so it only warns beyond
// clockWarnAfter, where the operator should fix NTP.
func clockCheck(dataDir string) Check {
	c := Check{Name: "clock", Status: OK}
	off, learned, err := servertime.Read(dataDir)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		c.Detail = "the control plane's time is not known yet (bcd learns it from its answers)"
	case err != nil:
		c.Status, c.Detail = Warn, err.Error()
	default:
		c.Detail = fmt.Sprintf("offset %s from the control plane's clock (learned %s); bcd dates what it signs by the control plane's clock: %s",
			off.Round(time.Millisecond), learned.UTC().Format(time.RFC3339), servertime.Describe(off))
		if off > clockWarnAfter || off < -clockWarnAfter {
			c.Status = Warn
		}
	}
	return c
}

// clockWarnAfter is the offset beyond which bcd doctor warns.
const clockWarnAfter = 30 * time.Second

// ExpiredMessage is the message for an expired identity (R11.4).
func ExpiredMessage(notAfter time.Time) string {
	return fmt.Sprintf("the certificate expired at %s; %s", notAfter.UTC().Format(time.RFC3339), identity.ExpiredFix(notAfter))
}

func identityCheck(cfg *bcdconfig.Config, dataDir string, now time.Time) Check {
	c := Check{Name: "identity"}
	_, store, err := tpmkeys.Stores(cfg, dataDir)
	if err != nil {
		c.Status, c.Detail = Fail, err.Error()
		return c
	}
	id, err := store.Load()
	var retired bool
	var at time.Time
	if err == nil {
		at, retired, err = retiredAt(store.Dir, id)
	}
	switch {
	case retired:
		c.Status, c.Detail = Fail, retiredMessage(id, at)
	case errors.Is(err, identity.ErrNotJoined):
		c.Status, c.Detail = Warn, fmt.Sprintf("not joined (no identity in %s): bcd join < join-token", dataDir)
	case err != nil:
		c.Status, c.Detail = Fail, err.Error()
	case id.Expired(now):
		c.Status, c.Detail = Fail, ExpiredMessage(id.NotAfter)
	default:
		left := id.NotAfter.Sub(now)
		c.Status, c.Detail = OK, fmt.Sprintf("node %s (%s), certificate valid until %s (%s left)", id.NodeID, id.Role, id.NotAfter.UTC().Format(time.RFC3339), left.Round(time.Second))
		if leaf := id.Leaf(); leaf != nil {
			if life := leaf.NotAfter.Sub(leaf.NotBefore); life > 0 && left < life/10 {
				c.Status = Warn
				c.Detail += "; renewal is overdue (bcd renews at about 60% of the lifetime): is bcd running?"
			}
		}
	}
	return c
}

func gatewayCheck(ctx context.Context, cfg *bcdconfig.Config, o Options) Check {
	c := Check{Name: "gateway"}
	u, err := url.Parse(cfg.GatewayURL)
	if err != nil {
		c.Status, c.Detail = Fail, fmt.Sprintf("gateway_url: %v", err)
		return c
	}
	host := u.Host
	if u.Port() == "" {
		host = net.JoinHostPort(u.Hostname(), "443")
	}
	name := cfg.GatewayServerName
	if name == "" {
		name = u.Hostname()
	}
	tc, err := enroll.PinnedTLSConfig(cfg.ServingCAPins(), name, o.Clock.Now)
	if err != nil {
		c.Status, c.Detail = Fail, err.Error()
		return c
	}
	ctx, cancel := context.WithTimeout(ctx, o.DialTimeout)
	defer cancel()
	d := tls.Dialer{Config: tc}
	conn, err := d.DialContext(ctx, "tcp", host)
	if err != nil {
		c.Status, c.Detail = Fail, fmt.Sprintf("cannot reach %s with the pinned serving CA: %v", host, err)
		return c
	}
	conn.Close()
	c.Status, c.Detail = OK, fmt.Sprintf("%s answers TLS under a pinned serving CA", host)
	return c
}

// pinsCheck shows the pin sets (R16.2), oldest first, the newest marked;
// during a rotation a kind has two.
func pinsCheck(cfg *bcdconfig.Config) Check {
	var parts []string
	for _, k := range bcdconfig.PinKinds() {
		set := cfg.PinSet(k)
		s := make([]string, len(set))
		for i, p := range set {
			s[i] = p
			if i == len(set)-1 && len(set) > 1 {
				s[i] += " (newest)"
			}
		}
		parts = append(parts, fmt.Sprintf("%s: %s", k, strings.Join(s, ", ")))
	}
	return Check{Name: "pins", Status: OK, Detail: strings.Join(parts, "; ")}
}

// tpmCheck reports the TPM (R9.1): whether it opens, its EK's kind, the
// AK's name (the certificate statement it would carry) and the kind of the
// node key in node.key.
func tpmCheck(cfg *bcdconfig.Config, dataDir string) Check {
	c := Check{Name: "tpm"}
	t := cfg.TPM
	where := t.Device
	if t.Simulator != "" {
		where = "swtpm:" + t.Simulator
	}
	if t.Mode == bcdconfig.TPMOff {
		c.Status, c.Detail = Skip, "tpm.mode = off: the node key is a software key"
		return c
	}
	keys, err := tpmkeys.Open(t)
	if err != nil || keys == nil {
		detail := fmt.Sprintf("no TPM at %s: the node key is a software key (node.key)", where)
		if err != nil {
			detail = err.Error()
		}
		c.Status, c.Detail = failOrWarn(t.Mode), detail
		return c
	}
	ek, err := keys.TPM.DefaultEK()
	if err != nil {
		c.Status, c.Detail = Fail, fmt.Sprintf("TPM %s present, but its endorsement key does not read: %v", where, err)
		return c
	}
	ak, err := keys.TPM.AK()
	if err != nil {
		c.Status, c.Detail = Fail, fmt.Sprintf("TPM %s present, but it cannot derive the attestation key: %v", where, err)
		return c
	}
	stmt, _ := tpmverify.Statement(ak.Name)
	cert := "no EK certificate"
	if len(ek.Cert) > 0 {
		cert = "EK certificate in NV"
	}
	nodeKey := "none yet"
	if rec, err := os.ReadFile(filepath.Join(dataDir, identity.KeyFile)); err == nil {
		nodeKey = identity.RecordKind(rec)
	}
	// The EK's hash is what an operator pastes into a pool's ek_sha256
	// (R9.2) to trust this machine.
	ekHash := "unreadable"
	if h, err := tpmverify.EKHash(&ek.Public); err == nil {
		ekHash = hex.EncodeToString(h)
	}
	c.Status, c.Detail = OK, fmt.Sprintf("TPM %s present; EK %s (%s), ek_sha256 %s; AK %s; node key %s", where, ek.Kind, cert, ekHash, stmt, nodeKey)
	return c
}

func failOrWarn(mode bcdconfig.TPMMode) string {
	if mode == bcdconfig.TPMRequired {
		return Fail
	}
	return Warn
}

// Failed reports whether any check failed.
func Failed(cs []Check) bool {
	for _, c := range cs {
		if c.Status == Fail {
			return true
		}
	}
	return false
}
