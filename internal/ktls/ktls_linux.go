//go:build linux

package ktls

import (
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Values from include/uapi/linux/tls.h that golang.org/x/sys/unix does not define
// (it has SOL_TLS and TCP_ULP).
const (
	tlsTX             = 1      // TLS_TX
	tlsRX             = 2      // TLS_RX
	tls13Version      = 0x0304 // TLS_1_3_VERSION
	tlsSetRecordType  = 1      // TLS_SET_RECORD_TYPE (sendmsg cmsg)
	tlsGetRecordType  = 2      // TLS_GET_RECORD_TYPE (recvmsg cmsg)
	tlsRecordSeqBytes = 8      // TLS_CIPHER_*_REC_SEQ_SIZE
)

// cryptoInfo is the kernel's struct for one direction: struct tls_crypto_info {__u16
// version, cipher_type}, then for tls12_crypto_info_aes_gcm_128/_256 iv[8] key[16|32]
// salt[4] rec_seq[8] (salt = the first 4 bytes of the TLS 1.3 IV, iv = the last 8), and
// for tls12_crypto_info_chacha20_poly1305 iv[12] key[32] rec_seq[8] (no salt). All byte
// arrays after two u16s, so no padding. The record sequence number is 0 (see the package
// doc).
func cryptoInfo(s suite, key, iv []byte) []byte {
	b := binary.NativeEndian.AppendUint16(nil, tls13Version)
	b = binary.NativeEndian.AppendUint16(b, s.kernelCipher)
	if s.kernelCipher == tlsCipherChaCha20Poly1305 {
		b = append(b, iv...)
		b = append(b, key...)
	} else {
		b = append(b, iv[4:]...)
		b = append(b, key...)
		b = append(b, iv[:4]...)
	}
	return append(b, make([]byte, tlsRecordSeqBytes)...)
}

func enable(tcp *net.TCPConn, k *trafficKeys, st tls.ConnectionState) (*Conn, error) {
	rc, err := tcp.SyscallConn()
	if err != nil {
		return nil, &FallbackError{Reason: ReasonNoKernelTLS, Err: err}
	}
	tx, rx := cryptoInfo(k.suite, k.txKey, k.txIV), cryptoInfo(k.suite, k.rxKey, k.rxIV)
	defer clear(tx)
	defer clear(rx)
	var ferr *FallbackError
	cerr := rc.Control(func(fd uintptr) {
		// Without TLS_TX and TLS_RX the ULP alone leaves the socket plain TCP, so a
		// failure up to TLS_TX falls back cleanly.
		if err := setULP(int(fd)); err != nil {
			ferr = &FallbackError{Reason: ReasonNoKernelTLS, Err: fmt.Errorf("setsockopt TCP_ULP tls: %w", err)}
			return
		}
		if err := unix.SetsockoptString(int(fd), unix.SOL_TLS, tlsTX, string(tx)); err != nil {
			ferr = &FallbackError{Reason: ReasonKernelKeys, Err: fmt.Errorf("setsockopt TLS_TX: %w", err)}
			return
		}
		if err := unix.SetsockoptString(int(fd), unix.SOL_TLS, tlsRX, string(rx)); err != nil {
			ferr = &FallbackError{Reason: ReasonKernelKeys, Err: fmt.Errorf("setsockopt TLS_RX: %w", err), Unusable: true}
		}
	})
	if cerr != nil {
		return nil, &FallbackError{Reason: ReasonNoKernelTLS, Err: cerr}
	}
	if ferr != nil {
		return nil, ferr
	}
	c := &Conn{tcp: tcp, rc: rc, state: st, infoLen: len(tx)}
	c.recvFn, c.sendFn = c.recvCall, c.sendCall
	return c, nil
}

// setULP installs the TLS ULP; one already there (Available) is fine.
func setULP(fd int) error {
	if err := unix.SetsockoptString(fd, unix.SOL_TCP, unix.TCP_ULP, "tls"); err != nil && err != unix.EEXIST {
		return err
	}
	return nil
}

// cmsgSpace fits one TLS record-type control message.
var cmsgSpace = unix.CmsgSpace(1)

// Conn is a TCP connection whose TLS records the kernel encrypts and decrypts. Write is
// write(2); Read is recvmsg(2) asking for each record's type, so that a non-application
// record (which read(2) would fail with EIO) is recognized: NewSessionTicket messages are
// dropped, close_notify reads as io.EOF, KeyUpdate as ErrKeyUpdate, anything else as a
// *RecordError. Those three end the read side for good.
type Conn struct {
	tcp     *net.TCPConn
	rc      syscall.RawConn
	state   tls.ConnectionState
	infoLen int // the size of this cipher's crypto_info, which getsockopt must be given exactly

	rmu  sync.Mutex // serializes Read, guards the fields below
	oob  [64]byte
	ctl  []byte // a control record's plaintext gathered across Reads
	ctlT uint8  // its content type
	rerr error  // sticky: io.EOF, ErrKeyUpdate, *RecordError, a decryption failure
	// recv's poll callback (made once: a closure per Read would allocate) and its
	// arguments and results.
	recvFn      func(fd uintptr) bool
	recvB       []byte
	recvN, oobN int
	recvErr     error
	iov         unix.Iovec
	msg         unix.Msghdr

	wmu         sync.Mutex // guards closeNotify
	closeNotify bool       // close_notify sent

	smu       sync.Mutex // serializes send and guards its callback's fields, as recv's
	sendFn    func(fd uintptr) bool
	sendB     []byte
	sendOOB   []byte
	sendFlags int
	sendDone  int
	sendErr   error
}

// ConnectionState is the *tls.Conn's state at the end of the handshake (peer
// certificates, ALPN, cipher suite).
func (c *Conn) ConnectionState() tls.ConnectionState { return c.state }

// NetConn is the socket, for splice(2) and socket options. Its own Read and Write are
// raw read(2) and write(2) on the kernel TLS socket.
func (c *Conn) NetConn() *net.TCPConn { return c.tcp }

// SyscallConn lets a Splicer use the socket.
func (c *Conn) SyscallConn() (syscall.RawConn, error) { return c.rc, nil }

func (c *Conn) Read(b []byte) (int, error) {
	c.rmu.Lock()
	defer c.rmu.Unlock()
	for {
		if c.rerr != nil {
			return 0, c.rerr
		}
		if len(b) == 0 {
			return 0, nil
		}
		n, typ, err := c.recv(b)
		if err != nil {
			if errors.Is(err, unix.EBADMSG) || errors.Is(err, unix.EIO) || errors.Is(err, unix.EMSGSIZE) {
				c.rerr = fmt.Errorf("ktls: read: bad record: %w", err)
				return 0, c.rerr
			}
			return 0, err
		}
		if n == 0 {
			c.rerr = io.EOF // TCP FIN without close_notify: crypto/tls reads io.EOF too
			return 0, c.rerr
		}
		if typ == 0 || typ == recordTypeApplicationData {
			return n, nil
		}
		if c.rerr = c.control(typ, b[:n]); c.rerr != nil {
			c.ctl = nil
		}
	}
}

// recv is one recvmsg(2) with room for the TLS_GET_RECORD_TYPE control message.
func (c *Conn) recv(b []byte) (n int, typ uint8, err error) {
	c.recvB = b
	err = c.rc.Read(c.recvFn)
	n, oobn, serr := c.recvN, c.oobN, c.recvErr
	c.recvB, c.recvErr = nil, nil
	oob := c.oob[:cmsgSpace]
	if err == nil && serr != nil {
		err = &net.OpError{Op: "read", Net: "tcp", Source: c.tcp.LocalAddr(), Addr: c.tcp.RemoteAddr(), Err: serr}
	}
	if err != nil {
		return 0, 0, err
	}
	if oobn >= unix.CmsgLen(1) {
		h := (*unix.Cmsghdr)(unsafe.Pointer(&oob[0]))
		if h.Level == unix.SOL_TLS && h.Type == tlsGetRecordType {
			typ = oob[unix.CmsgLen(0)]
		}
	}
	return n, typ, nil
}

// recvCall is recvmsg(2) into c.recvB (never empty) and c.oob. Not unix.Recvmsg: its
// sockaddr escapes, one allocation per call.
func (c *Conn) recvCall(fd uintptr) bool {
	c.iov = unix.Iovec{Base: &c.recvB[0]}
	c.iov.SetLen(len(c.recvB))
	c.msg = unix.Msghdr{Iov: &c.iov, Control: &c.oob[0]}
	c.msg.SetIovlen(1)
	c.msg.SetControllen(cmsgSpace)
	n, _, errno := unix.Syscall(unix.SYS_RECVMSG, fd, uintptr(unsafe.Pointer(&c.msg)), 0)
	c.recvN, c.oobN, c.recvErr = int(n), int(c.msg.Controllen), nil
	if errno != 0 {
		c.recvN, c.oobN, c.recvErr = 0, 0, errno
	}
	c.iov, c.msg = unix.Iovec{}, unix.Msghdr{}
	return c.recvErr != unix.EAGAIN
}

// control takes (part of) a non-application record. It returns nil to read on, or the
// error that ends the read side.
func (c *Conn) control(typ uint8, data []byte) error {
	if typ != c.ctlT {
		c.ctl, c.ctlT = c.ctl[:0], typ
	}
	c.ctl = append(c.ctl, data...)
	switch typ {
	case recordTypeAlert:
		if len(c.ctl) < 2 {
			return nil
		}
		if c.ctl[1] == 0 { // close_notify
			return io.EOF
		}
		return &RecordError{Type: typ, Data: c.ctl[:2]}
	case recordTypeHandshake:
		for len(c.ctl) >= 4 {
			n := int(c.ctl[1])<<16 | int(c.ctl[2])<<8 | int(c.ctl[3])
			if n > 1<<16 {
				return &RecordError{Type: typ, Data: c.ctl[:4]}
			}
			if len(c.ctl) < 4+n {
				return nil
			}
			switch c.ctl[0] {
			case typeNewSessionTicket: // this client does not resume sessions
			case typeKeyUpdate:
				return ErrKeyUpdate
			default:
				return &RecordError{Type: typ, Data: c.ctl[:4+n]}
			}
			c.ctl = c.ctl[4+n:]
		}
		if len(c.ctl) == 0 {
			c.ctl = nil
		}
		return nil
	}
	return &RecordError{Type: typ, Data: c.ctl}
}

func (c *Conn) Write(b []byte) (int, error) { return c.tcp.Write(b) }

// Records returns the kernel's record sequence numbers, the count of records each
// direction has protected under its current key (getsockopt TLS_TX and TLS_RX return the
// crypto_info, rec_seq last). The caller drains a connection before a key's limit with
// it: the kernel here follows no KeyUpdate, so a key lives as long as the connection.
func (c *Conn) Records() (tx, rx uint64, err error) {
	var buf [64]byte
	info := buf[:c.infoLen]
	defer clear(buf[:]) // the key is in it
	serr := c.rc.Control(func(fd uintptr) {
		for i, opt := range [2]int{tlsTX, tlsRX} {
			n := uint32(len(info))
			_, _, errno := unix.Syscall6(unix.SYS_GETSOCKOPT, fd, unix.SOL_TLS, uintptr(opt),
				uintptr(unsafe.Pointer(&info[0])), uintptr(unsafe.Pointer(&n)), 0)
			if errno != 0 {
				err = fmt.Errorf("ktls: getsockopt %d: %w", opt, errno)
				return
			}
			if int(n) != len(info) {
				err = fmt.Errorf("ktls: getsockopt %d: %d bytes, want %d", opt, n, len(info))
				return
			}
			seq := binary.BigEndian.Uint64(info[len(info)-tlsRecordSeqBytes:])
			if i == 0 {
				tx = seq
			} else {
				rx = seq
			}
		}
	})
	if err == nil {
		err = serr
	}
	return tx, rx, err
}

// WriteMore writes b with MSG_MORE: the kernel keeps the TLS record open, so what the
// next Write or Splicer.Drain sends joins it. A 9-byte HTTP/2 frame header written this
// way shares its record with the payload spliced after it instead of costing a record
// (22 bytes and an AEAD operation) of its own.
func (c *Conn) WriteMore(b []byte) (int, error) {
	return c.send(b, nil, unix.MSG_MORE)
}

// writeRecord sends data as one record of content type typ (TLS_SET_RECORD_TYPE).
func (c *Conn) writeRecord(typ uint8, data []byte) error {
	oob := make([]byte, cmsgSpace)
	h := (*unix.Cmsghdr)(unsafe.Pointer(&oob[0]))
	h.Level = unix.SOL_TLS
	h.Type = tlsSetRecordType
	h.SetLen(unix.CmsgLen(1))
	oob[unix.CmsgLen(0)] = typ
	_, err := c.send(data, oob, 0)
	return err
}

func (c *Conn) send(b, oob []byte, flags int) (int, error) {
	c.smu.Lock()
	defer c.smu.Unlock()
	c.sendB, c.sendOOB, c.sendFlags, c.sendDone, c.sendErr = b, oob, flags, 0, nil
	err := c.rc.Write(c.sendFn)
	done, serr := c.sendDone, c.sendErr
	c.sendB, c.sendOOB, c.sendErr = nil, nil, nil
	if err == nil && serr != nil {
		err = &net.OpError{Op: "write", Net: "tcp", Source: c.tcp.LocalAddr(), Addr: c.tcp.RemoteAddr(), Err: serr}
	}
	return done, err
}

func (c *Conn) sendCall(fd uintptr) bool {
	for c.sendDone < len(c.sendB) {
		n, err := unix.SendmsgN(int(fd), c.sendB[c.sendDone:], c.sendOOB, nil, c.sendFlags)
		if err != nil {
			c.sendErr = err
			return err != unix.EAGAIN
		}
		c.sendDone += n
		c.sendOOB = nil // a cmsg goes with the first bytes only
	}
	c.sendErr = nil
	return true
}

// CloseWrite sends close_notify and shuts the socket's write side (FIN), as
// tls.Conn.CloseWrite followed by a TCP half-close: the peer reads io.EOF and may go on
// writing.
func (c *Conn) CloseWrite() error {
	if err := c.sendCloseNotify(); err != nil {
		return err
	}
	return c.tcp.CloseWrite()
}

func (c *Conn) sendCloseNotify() error {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	if c.closeNotify {
		return nil
	}
	c.closeNotify = true
	return c.writeRecord(recordTypeAlert, []byte{1, 0}) // warning, close_notify
}

// Close sends close_notify (waiting at most 5 s, as crypto/tls does) and closes the socket.
func (c *Conn) Close() error {
	_ = c.tcp.SetWriteDeadline(time.Now().Add(5 * time.Second))
	_ = c.sendCloseNotify()
	return c.tcp.Close()
}

func (c *Conn) LocalAddr() net.Addr                { return c.tcp.LocalAddr() }
func (c *Conn) RemoteAddr() net.Addr               { return c.tcp.RemoteAddr() }
func (c *Conn) SetDeadline(t time.Time) error      { return c.tcp.SetDeadline(t) }
func (c *Conn) SetReadDeadline(t time.Time) error  { return c.tcp.SetReadDeadline(t) }
func (c *Conn) SetWriteDeadline(t time.Time) error { return c.tcp.SetWriteDeadline(t) }

var _ net.Conn = (*Conn)(nil)

// KernelRekeys reports whether the kernel can take a new key on a kernel TLS socket that
// already has one (TLS 1.3 key updates, Linux 6.14's "tls: implement key updates for
// TLS1.3"): a second setsockopt(TLS_RX) succeeds there and fails with EBUSY before. It
// asks once, on a loopback connection of its own, with a throwaway key. This package does
// not follow KeyUpdates even where the kernel could (see the package doc): the answer is
// for operators, in /config_dump.
var KernelRekeys = sync.OnceValue(kernelRekeys)

func kernelRekeys() bool {
	ln, err := net.ListenTCP("tcp", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		return false
	}
	defer ln.Close()
	c, err := net.DialTCP("tcp", nil, ln.Addr().(*net.TCPAddr))
	if err != nil {
		return false
	}
	defer c.Close()
	s, err := ln.AcceptTCP()
	if err != nil {
		return false
	}
	defer s.Close()
	rc, err := c.SyscallConn()
	if err != nil {
		return false
	}
	info := cryptoInfo(suite{tlsCipherAESGCM128, 16, nil}, make([]byte, 16), make([]byte, 12))
	ok := false
	rc.Control(func(fd uintptr) {
		if setULP(int(fd)) != nil {
			return
		}
		if unix.SetsockoptString(int(fd), unix.SOL_TLS, tlsRX, string(info)) != nil {
			return
		}
		ok = unix.SetsockoptString(int(fd), unix.SOL_TLS, tlsRX, string(info)) == nil
	})
	return ok
}
