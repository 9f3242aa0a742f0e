// Package tpmdevice owns every operation bcd performs on a TPM 2.0 (R9): opening
// the kernel's resource manager (/dev/tpmrm0) or an swtpm command port, the
// endorsement key and its certificate, the attestation key, node keys that
// never leave the TPM (a crypto.Signer and their "TSS2 PRIVATE KEY" record),
// TPM2_Certify of a node key by the AK, and credential activation.
//
// Handle hygiene: swtpm has three transient object slots and a raw TCP TPM
// does not flush what a killed client left behind, so every operation is an
// op (begin, defer end): it holds the TPM's lock for its whole sequence of
// commands, loads what it needs through the op, and the op flushes all of
// it before the operation returns, on every path. Nothing stays loaded between
// operations; keys are re-derived (primaries) or reloaded (node keys under
// the SRK) each time.
package tpmdevice

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"time"

	"github.com/google/go-tpm/tpm2"
	"github.com/google/go-tpm/tpm2/transport"
)

// Config says which TPM to open.
type Config struct {
	// Device is a TPM character device (the resource manager /dev/tpmrm0).
	Device string
	// Simulator is an swtpm command port, host:port; when set it is used
	// instead of Device.
	Simulator string
}

// TPM is a TPM. Its methods are safe for concurrent use: each holds the
// TPM for its whole command sequence.
//
// swtpm serves one connection at a time, and a daemon that held its TPM
// open would lock out `bcd doctor`; so a TPM from Open connects for each
// operation and closes after it (the kernel's resource manager also flushes
// what a connection left on close). OpenSimulator and OpenDevice keep one
// connection until Close.
type TPM struct {
	mu   sync.Mutex
	t    transport.TPMCloser // the connection while an operation holds mu
	dial func() (roundTripper, error)
	keep bool // keep t between operations
	desc string
}

// Open returns the configured TPM, connecting for each operation. It
// checks that the TPM answers once.
func Open(cfg Config) (*TPM, error) {
	t := &TPM{desc: cfg.Device}
	if cfg.Simulator != "" {
		t.desc = "swtpm:" + cfg.Simulator
		t.dial = func() (roundTripper, error) { return dialSimulator(cfg.Simulator) }
	} else {
		t.dial = func() (roundTripper, error) { return openDevice(cfg.Device) }
	}
	o, err := t.begin()
	if err != nil {
		return nil, err
	}
	o.end()
	return t, nil
}

// OpenDevice opens a TPM character device and keeps it open until Close.
func OpenDevice(path string) (*TPM, error) {
	return openKept(path, func() (roundTripper, error) { return openDevice(path) })
}

// OpenSimulator connects to an swtpm command port (host:port) and keeps
// the connection until Close.
func OpenSimulator(addr string) (*TPM, error) {
	return openKept("swtpm:"+addr, func() (roundTripper, error) { return dialSimulator(addr) })
}

func openKept(desc string, dial func() (roundTripper, error)) (*TPM, error) {
	rt, err := dial()
	if err != nil {
		return nil, err
	}
	return &TPM{t: &retrying{rw: rt}, dial: dial, keep: true, desc: desc}, nil
}

func openDevice(path string) (roundTripper, error) {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return nil, fmt.Errorf("open TPM %s: %w", path, err)
	}
	return &deviceRW{f: f}, nil
}

func dialSimulator(addr string) (roundTripper, error) {
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		return nil, fmt.Errorf("connect to swtpm at %s: %w", addr, err)
	}
	return &streamRW{c: c}, nil
}

// acquire takes the TPM for one operation, connecting when needed.
func (t *TPM) acquire() error {
	t.mu.Lock()
	if t.t != nil {
		return nil
	}
	if t.keep {
		t.mu.Unlock()
		return errors.New("the TPM connection is closed")
	}
	rt, err := t.dial()
	if err != nil {
		t.mu.Unlock()
		return err
	}
	t.t = &retrying{rw: rt}
	return nil
}

// unlock ends an operation, closing an on-demand connection.
func (t *TPM) unlock() {
	if !t.keep && t.t != nil {
		_ = t.t.Close()
		t.t = nil
	}
	t.mu.Unlock()
}

// String names the TPM for messages: its device or swtpm address.
func (t *TPM) String() string { return t.desc }

// Close closes a kept connection.
func (t *TPM) Close() error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.t == nil {
		return nil
	}
	err := t.t.Close()
	t.t = nil
	return err
}

// roundTripper sends one command and returns its whole response.
type roundTripper interface {
	roundTrip(cmd []byte) ([]byte, error)
	io.Closer
}

// headerLen is a TPM response header: tag (2), size (4), response code (4).
const headerLen = 10

// maxResponse bounds a response (TPM responses are a few KiB).
const maxResponse = 64 << 10

// streamRW is swtpm's TCP command port: a byte stream, so the response is
// read as its 10-byte header, then the rest its size field announces
// (go-tpm's mssim transport speaks another protocol).
type streamRW struct{ c net.Conn }

func (s *streamRW) roundTrip(cmd []byte) ([]byte, error) {
	if err := s.c.SetDeadline(time.Now().Add(2 * time.Minute)); err != nil {
		return nil, err
	}
	if _, err := s.c.Write(cmd); err != nil {
		return nil, fmt.Errorf("write TPM command: %w", err)
	}
	hdr := make([]byte, headerLen)
	if _, err := io.ReadFull(s.c, hdr); err != nil {
		return nil, fmt.Errorf("read TPM response: %w", err)
	}
	size := binary.BigEndian.Uint32(hdr[2:6])
	if size < headerLen || size > maxResponse {
		return nil, fmt.Errorf("TPM response size %d out of range", size)
	}
	rsp := make([]byte, size)
	copy(rsp, hdr)
	if _, err := io.ReadFull(s.c, rsp[headerLen:]); err != nil {
		return nil, fmt.Errorf("read TPM response: %w", err)
	}
	return rsp, nil
}

func (s *streamRW) Close() error { return s.c.Close() }

// deviceRW is a TPM character device: one write, one read of the whole
// response.
type deviceRW struct{ f *os.File }

func (d *deviceRW) roundTrip(cmd []byte) ([]byte, error) {
	if _, err := d.f.Write(cmd); err != nil {
		return nil, fmt.Errorf("write TPM command: %w", err)
	}
	buf := make([]byte, maxResponse)
	n, err := d.f.Read(buf)
	if err != nil {
		return nil, fmt.Errorf("read TPM response: %w", err)
	}
	if n < headerLen {
		return nil, errors.New("short TPM response")
	}
	return buf[:n], nil
}

func (d *deviceRW) Close() error { return d.f.Close() }

// Warnings after which the TPM asks for the same command again.
var retryCodes = map[tpm2.TPMRC]bool{tpm2.TPMRCRetry: true, tpm2.TPMRCYielded: true, tpm2.TPMRCTesting: true}

// maxRetries bounds the resends of one command.
const maxRetries = 50

// retrying resends a command the TPM answered with RETRY, YIELDED or
// TESTING, backing off a little each time.
type retrying struct{ rw roundTripper }

func (r *retrying) Send(cmd []byte) ([]byte, error) {
	for i := 0; ; i++ {
		rsp, err := r.rw.roundTrip(cmd)
		if err != nil {
			return nil, err
		}
		rc := tpm2.TPMRC(binary.BigEndian.Uint32(rsp[6:10]))
		if !retryCodes[rc] || i >= maxRetries {
			return rsp, nil
		}
		time.Sleep(time.Duration(i+1) * 2 * time.Millisecond)
	}
}

func (r *retrying) Close() error { return r.rw.Close() }
