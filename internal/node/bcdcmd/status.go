package bcdcmd

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/better-compute/better-compute/internal/node/cmdline"

	"github.com/better-compute/better-compute/internal/node/identity"
	"github.com/better-compute/better-compute/internal/node/tpmkeys"
	"github.com/better-compute/better-compute/internal/shared/bcdconfig"
	"github.com/better-compute/better-compute/internal/shared/errs"
)

// Status is what `bcd status --json` and `bcd join --json` print.
type Status struct {
	Joined      bool      `json:"joined"`
	DataDir     string    `json:"dataDir"`
	NodeID      string    `json:"nodeId,omitempty"`
	SPIFFEID    string    `json:"spiffeId,omitempty"`
	TrustDomain string    `json:"trustDomain,omitempty"`
	SiteID      string    `json:"siteId,omitempty"`
	Role        string    `json:"role,omitempty"`
	Serial      string    `json:"serial,omitempty"`
	NotAfter    time.Time `json:"notAfter,omitzero"`
	Expired     bool      `json:"expired"`
	KeyKind     string    `json:"keyKind,omitempty"`
	Attestor    string    `json:"attestor,omitempty"`
	JoinedAt    time.Time `json:"joinedAt,omitzero"`
}

func statusOf(id *identity.Identity, dataDir string, now time.Time) Status {
	return Status{
		Joined: true, DataDir: dataDir,
		NodeID: id.NodeID, SPIFFEID: id.SPIFFEID, TrustDomain: id.TrustDomain, SiteID: id.SiteID,
		Role: id.Role, Serial: id.Serial, NotAfter: id.NotAfter, Expired: id.Expired(now),
		KeyKind: id.KeyKind, Attestor: id.Attestor, JoinedAt: id.JoinedAt,
	}
}

type statusFlags struct {
	configPath string
	// configSet is true when --config was given: a missing file is then an
	// error, never a fall back to the default data directory.
	configSet bool
	dataDir   string
	json      bool
}

func (a *app) statusCmd() *cmdline.Command {
	var f statusFlags
	cmd := &cmdline.Command{
		Use:   "status",
		Short: "Show this machine's node identity (exit code 1 when not joined)",
		Args:  noArgs,
		RunE: func(cmd *cmdline.Command, _ []string) error {
			f.configSet = cmd.Flags().Changed("config")
			return a.status(&f)
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&f.configPath, "config", bcdconfig.DefaultPath, "bcd's config.toml, for its data_dir")
	fl.StringVar(&f.dataDir, "data-dir", "", "the identity's directory (default: the config's data_dir, else "+bcdconfig.DefaultDataDir+")")
	fl.BoolVar(&f.json, "json", false, "print JSON")
	return cmd
}

func (a *app) status(f *statusFlags) error {
	dir, err := absDir("--data-dir", f.dataDir)
	if err != nil {
		return err
	}
	if dir == "" {
		cfg, err := loadConfig(f.configPath)
		if err != nil {
			return err
		}
		dir = bcdconfig.DefaultDataDir
		switch {
		case cfg != nil:
			dir = cfg.DataDir
		case f.configSet:
			// A named config that is not there is a typo or a wrong
			// machine: answering for /var/lib/bcd would hide it.
			return errs.New(errs.InvalidConfig, "no bcd config at %s: name the config bcd joined with (--config), or its identity directory (--data-dir)", f.configPath)
		}
	}
	// A node key in the TPM opens through it (R9.1).
	var tcfg *bcdconfig.Config
	if c, cerr := loadConfig(f.configPath); cerr == nil {
		tcfg = c
	}
	_, store, err := tpmkeys.Stores(tcfg, dir)
	if err != nil {
		return err
	}
	id, err := store.Load()
	if errors.Is(err, identity.ErrNotJoined) {
		if f.json {
			if err := printJSON(a.env.Stdout, Status{DataDir: dir}); err != nil {
				return err
			}
		} else {
			fmt.Fprintf(a.env.Stdout, "not joined: no identity in %s; join with: bcd join < join-token\n", dir)
		}
		return &exitError{code: 1}
	}
	if err != nil {
		return err
	}
	now := a.env.Clock.Now()
	st := statusOf(id, dir, now)
	if f.json {
		return printJSON(a.env.Stdout, st)
	}
	validity := fmt.Sprintf("%s (valid for %s)", st.NotAfter.Format(time.RFC3339), st.NotAfter.Sub(now).Truncate(time.Second))
	if st.Expired {
		validity = fmt.Sprintf("%s (EXPIRED; %s)", st.NotAfter.Format(time.RFC3339), identity.ExpiredFix(st.NotAfter))
	}
	tw := tabwriter.NewWriter(a.env.Stdout, 0, 0, 2, ' ', 0)
	for _, row := range [][2]string{
		{"node", st.NodeID},
		{"SPIFFE ID", st.SPIFFEID},
		{"site", st.SiteID},
		{"role", st.Role},
		{"serial", st.Serial},
		{"not after", validity},
		{"key", st.KeyKind},
		{"attestor", st.Attestor},
		{"joined at", st.JoinedAt.Format(time.RFC3339)},
		{"data dir", st.DataDir},
	} {
		fmt.Fprintf(tw, "%s:\t%s\n", row[0], row[1])
	}
	return tw.Flush()
}

func printJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}
