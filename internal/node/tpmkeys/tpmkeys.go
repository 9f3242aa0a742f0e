// Package tpmkeys is bcd's identity.KeyStore backed by the TPM (R9.1): node
// keys are made in the TPM, node.key holds only their "TSS2 PRIVATE KEY"
// record, and the AK certifies them for joins and renewals (R9.2, R13.3).
// Open decides from [tpm] in config.toml whether the TPM is used.
package tpmkeys

import (
	"crypto"
	"errors"
	"fmt"
	"os"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/internal/node/identity"
	"github.com/better-compute/better-compute/internal/node/tpmdevice"
	"github.com/better-compute/better-compute/internal/shared/bcdconfig"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/pki"
	"google.golang.org/protobuf/proto"
)

// Keys is the TPM KeyStore.
type Keys struct{ TPM *tpmdevice.TPM }

// Open returns the TPM keys config.toml asks for: nil (software keys) when
// tpm.mode is off, or is auto and no TPM opens; an error when it is
// required and none opens.
func Open(cfg bcdconfig.TPM) (*Keys, error) {
	if cfg.Mode == bcdconfig.TPMOff {
		return nil, nil
	}
	if cfg.Simulator == "" {
		if cfg.Device == "" {
			cfg.Device = bcdconfig.DefaultTPMDevice
		}
		if _, err := os.Stat(cfg.Device); err != nil && cfg.Mode != bcdconfig.TPMRequired {
			return nil, nil
		}
	}
	t, err := tpmdevice.Open(tpmdevice.Config{Device: cfg.Device, Simulator: cfg.Simulator})
	if err != nil {
		if cfg.Mode == bcdconfig.TPMRequired {
			return nil, errs.Wrap(err, errs.InvalidConfig, "tpm.mode is required, but the TPM does not open: %v", err)
		}
		return nil, nil
	}
	return &Keys{TPM: t}, nil
}

// GenerateKey makes a node key in the TPM.
func (k *Keys) GenerateKey() (crypto.Signer, []byte, error) {
	key, err := k.TPM.NewNodeKey()
	if err != nil {
		return nil, nil, err
	}
	rec, err := key.Record()
	if err != nil {
		return nil, nil, err
	}
	return key, rec, nil
}

// LoadKey reloads a node key from its record.
func (k *Keys) LoadKey(recordPEM []byte) (crypto.Signer, error) {
	key, err := k.TPM.LoadKey(recordPEM)
	if err != nil {
		return nil, errs.Wrap(err, errs.InvalidState, "the node key in node.key does not load into %s (was the TPM cleared or replaced?): %v; join again: bcd join --reset --yes, then bcd join --attestor tpm", k.TPM, err)
	}
	return key, nil
}

// AttestKey has the AK certify signer's key over sha256(csr): the
// key_attestation of a join or renewal, and the AK's TPM name.
func (k *Keys) AttestKey(signer crypto.Signer, csr []byte) (attestation, akName []byte, err error) {
	key, ok := signer.(*tpmdevice.Key)
	if !ok {
		return nil, nil, errors.New("the node key is not a TPM key")
	}
	att, err := k.TPM.Certify(key, pki.CSRHash(csr))
	if err != nil {
		return nil, nil, err
	}
	ak, err := k.TPM.AK()
	if err != nil {
		return nil, nil, err
	}
	b, err := att.Marshal()
	if err != nil {
		return nil, nil, err
	}
	return b, ak.Name, nil
}

// Evidence returns the tpm attestor's evidence (the EK and its
// certificate) and the EK's kind.
func (k *Keys) Evidence() ([]byte, tpmdevice.EKKind, error) {
	ek, err := k.TPM.DefaultEK()
	if err != nil {
		return nil, "", fmt.Errorf("read the endorsement key: %w", err)
	}
	b, err := proto.Marshal(&agentv1.TPMEvidence{EkPublic: ek.PublicBytes(), EkCertificate: ek.Cert})
	return b, ek.Kind, err
}

// Answer activates a tpm attestor challenge with the EK of kind.
func (k *Keys) Answer(kind tpmdevice.EKKind, challenge []byte) ([]byte, error) {
	var ch agentv1.TPMChallenge
	if err := proto.Unmarshal(challenge, &ch); err != nil {
		return nil, errors.New("the control plane's TPM challenge does not parse")
	}
	secret, err := k.TPM.ActivateCredential(kind, ch.GetCredentialBlob(), ch.GetEncryptedSecret())
	if err != nil {
		return nil, err
	}
	return proto.Marshal(&agentv1.TPMChallengeAnswer{Secret: secret, ExpiresUnixMs: ch.GetExpiresUnixMs()})
}

// Stores opens the TPM config.toml's [tpm] asks for (R9.1) and returns the
// KeyStore new node keys are made with and the identity store over dir
// that reopens them: the TPM's when one opens, else software keys (a nil
// KeyStore). A nil cfg means tpm.mode auto on the default device.
func Stores(cfg *bcdconfig.Config, dir string) (identity.KeyStore, *identity.Store, error) {
	t := bcdconfig.TPM{}
	if cfg != nil {
		t = cfg.TPM
	}
	keys, err := Open(t)
	if err != nil {
		return nil, nil, err
	}
	if keys == nil {
		return nil, &identity.Store{Dir: dir}, nil
	}
	return keys, &identity.Store{Dir: dir, TPMKeys: keys}, nil
}
