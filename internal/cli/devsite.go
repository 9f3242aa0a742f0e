package cli

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/api"
	"github.com/better-compute/better-compute/internal/controlplane/authz"
	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/tokens"
	"github.com/better-compute/better-compute/internal/shared/fakemachine"
)

// dev plays a site's modules too (R2.7, R10.4): it mints a site token and a
// ramdisk token for its pool into DIR/secrets/ (0600 files, the secret
// references), and writes bcd configurations for a site agent
// (DIR/site/config.toml) and for a machine the site network-booted
// (DIR/ramdisk/config.toml), each with a fake machine's sysfs tree, so the
// discovery flow runs on one laptop (docs/joining.md, "Join requests").

// The fake machine the dev site boots, and its boot. Its address is
// loopback: dev's gateway sees every daemon of the laptop come from
// 127.0.0.1, and the discovery attestor admits a ramdisk only from the
// address its site vouched for (R10.4).
const (
	devBootMAC = "00:1b:21:0a:0b:0c"
	devBootIP  = "127.0.0.1"
)

var (
	devSiteAgent = fakemachine.Machine{ProductUUID: "4c4c4544-0042-3510-8052-c7c04f5a0001", ProductSerial: "DEV-SITE-1", MACs: []string{"00:1b:21:0a:00:01"}}
	devBooted    = fakemachine.Machine{ProductUUID: "4c4c4544-0042-3510-8052-c7c04f5a0007", ProductSerial: "DEV-PXE-7", MACs: []string{devBootMAC}}
)

// devSecretsDir holds the tokens dev mints as a site module.
const devSecretsDir = "secrets"

// devSiteModule is the module dev mints its site tokens as.
const devSiteModule = "dev-site"

// mintDevSiteTokens mints, on each start, a site token (10 uses) and a
// ramdisk token (1000 uses) for dev's pool, valid 24 hours, into
// DIR/secrets/site.token and ramdisk.token. The previous start's are
// revoked first: their files are replaced, so nobody holds them, and each
// restart left two more live tokens behind.
func mintDevSiteTokens(ctx context.Context, s *api.Server, db *store.DB, dir string, st devState) (refs []string, err error) {
	sink := tokens.FileSink{Dir: filepath.Join(dir, devSecretsDir)}
	svc := tokens.New(tokens.Config{DB: db, Hub: s.Hub()})
	if err := revokeDevSiteTokens(ctx, svc, st); err != nil {
		return nil, err
	}
	for _, t := range []struct {
		role string
		uses int
	}{{tokens.RoleSite, 10}, {tokens.RoleRamdisk, 1000}} {
		name := t.role + ".token"
		if err := os.Remove(filepath.Join(sink.Dir, name)); err != nil && !os.IsNotExist(err) {
			return nil, err
		}
		_, ref, err := svc.MintInternal(ctx, sink, tokens.InternalRequest{Module: devSiteModule, TenantID: st.tenant, PoolID: st.pool,
			Role: t.role, TTL: 24 * time.Hour, MaxUses: t.uses, SecretName: name})
		if err != nil {
			return nil, err
		}
		refs = append(refs, ref)
	}
	return refs, nil
}

// revokeDevSiteTokens revokes the live tokens an earlier start minted.
func revokeDevSiteTokens(ctx context.Context, svc *tokens.Service, st devState) error {
	sys := authz.Principal{ID: "system:dev", TenantID: st.tenant, Name: "dev", Grants: authz.Admin, Root: true}
	live, err := svc.List(ctx, sys, st.tenant, st.pool, false, "", 1000)
	if err != nil {
		return err
	}
	for _, t := range live {
		if t.CreatedBy != "module:"+devSiteModule {
			continue
		}
		if _, err := svc.Revoke(ctx, sys, st.tenant, st.pool, t.ID); err != nil {
			return err
		}
	}
	return nil
}

// writeDevSiteConfigs writes the site agent's and the booted machine's bcd
// configurations and returns their paths.
func writeDevSiteConfigs(dir, gwURL, site string, b *ca.Bundle) (siteConf, ramdiskConf string, err error) {
	if siteConf, err = writeDevBCDAs(dir, "site", gwURL, site, b, &devSiteAgent, nil); err != nil {
		return "", "", err
	}
	if ramdiskConf, err = writeDevBCDAs(dir, "ramdisk", gwURL, site, b, &devBooted, nil); err != nil {
		return "", "", err
	}
	return siteConf, ramdiskConf, nil
}

// devDiscoveryBanner is the discovery walkthrough dev prints.
func devDiscoveryBanner(dir, siteConf, ramdiskConf string) string {
	secrets := filepath.Join(dir, devSecretsDir)
	var b strings.Builder
	fmt.Fprintf(&b, `
A site agent vouches for a machine it booted; the machine waits for approval:
  (bcd join --config %[1]s --role site --skip-if-joined < %[3]s/site.token && bcd run --config %[1]s) &
  bcd site vouch --config %[1]s --mac %[4]s --ip %[5]s --lease-epoch 1
  bcd join --config %[2]s --attestor discovery --role ramdisk \
    --boot-mac %[4]s --boot-ip %[5]s --boot-lease-epoch 1 < %[3]s/ramdisk.token &
  better-compute join-requests list --tenant $TENANT --pool $POOL
  better-compute join-requests approve jreq_… --tenant $TENANT --pool $POOL --ttl 900 --reason 'dev intake'
`, siteConf, ramdiskConf, secrets, devBootMAC, devBootIP)
	return b.String()
}
